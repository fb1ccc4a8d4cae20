"""LoRA adapters on the server: names that route to their base with the adapter passed to the
engine, in every API; /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, admin scope);
/v1/models with `parent`; per-key model lists; the lora_requests_info gauge; the TOML path.

The engine is fakes.FakeCore under the real AsyncLLMEngine: a request through adapter `x` replies
"[x] " + REPLY, so a test sees which adapter answered. Adapters loaded at run time are real PEFT
folders written here and checked by tessera.models.adapters.read_adapter against the fake's
ModelConfig (hidden 8, one head of 8).
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import httpx
import numpy as np
import pytest
from fakes import MODEL, REPLY, FakeCore, fake_engine, serve_in_thread
from safetensors.numpy import save_file
from test_multi_model import serving_spec

from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.engine.stats import SchedulerStats
from tessera.errors import TesseraError
from tessera.live_stats import LiveStats
from tessera.lora_config import LoRAModule
from tessera.metrics import MetricFamilies, PrometheusStatLogger
from tessera.server.app import create_app
from tessera.server.api_keys import ADMIN, INFERENCE, AccessSettings, ApiKey, digest_of
from tessera.server.model_router import ModelRouter
from tessera.server.served_model import ModelSpec, ServedModel

ADMIN_KEY, APP_KEY, SQL_ONLY_KEY, BASE_ONLY_KEY = "sk-admin-lora-01", "sk-app-lora-0001", "sk-sql-only-0001", \
    "sk-base-only-001"
KEYS = (ApiKey(name="ops", sha256=digest_of(ADMIN_KEY), scopes=frozenset({ADMIN})),
        ApiKey(name="app", sha256=digest_of(APP_KEY), scopes=frozenset({INFERENCE})),
        ApiKey(name="sql-only", sha256=digest_of(SQL_ONLY_KEY), models=frozenset({"sql"})),
        ApiKey(name="base-only", sha256=digest_of(BASE_ONLY_KEY), models=frozenset({MODEL})))


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


ADMIN_H, APP_H = bearer(ADMIN_KEY), bearer(APP_KEY)


def write_peft(folder: Path, rank: int = 4, hidden: int = 8, q_out: int = 8) -> Path:
    """A tiny PEFT LoRA folder adapting layer 0's q_proj and v_proj (shapes for `hidden`/`q_out`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
         "base_model_name_or_path": MODEL}))
    prefix = "base_model.model.model.layers.0.self_attn"
    tensors = {}
    for proj in ("q_proj", "v_proj"):
        tensors[f"{prefix}.{proj}.lora_A.weight"] = np.zeros((rank, hidden), np.float32)
        tensors[f"{prefix}.{proj}.lora_B.weight"] = np.zeros((q_out, rank), np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def core_sees(srv: "Srv", check, timeout_s: float = 5.0) -> bool:
    """Whether `check(core.loras)` holds within `timeout_s`: the engine hands adapters to its core
    through the step loop's command queue, so the core sees them a moment after the endpoint answers
    (requests sent after the answer are ordered behind them in that queue)."""
    deadline = time.monotonic() + timeout_s
    while not check(dict(srv.core.loras)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@dataclass
class Srv:
    url: str
    core: FakeCore
    engine: AsyncLLMEngine


@contextmanager
def lora_server(tmp: Path, *, enable_lora: bool = True, keys: tuple = ()) -> Iterator[Srv]:
    """A server of MODEL (alias "alias") with the adapter "sql" from start-up (when enabled)."""
    modules = (f"sql={write_peft(tmp / 'sql')}",) if enable_lora else ()
    core = FakeCore(enable_lora=enable_lora, lora_modules=modules)
    engine = AsyncLLMEngine(core.config, engine=core)
    app = create_app(engine, [MODEL, "alias"], access=AccessSettings(keys=keys), live=LiveStats(MODEL))
    try:
        with serve_in_thread(app) as url:
            yield Srv(url, core, engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[Srv]:
    with lora_server(tmp_path_factory.mktemp("lora")) as s:
        yield s


def load(srv: Srv, name: str, path, headers: Optional[dict] = None, **extra) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra},
                      headers=headers or {})


def unload(srv: Srv, name: str, headers: Optional[dict] = None) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers or {})


def chat(srv: Srv, model: str, headers: Optional[dict] = None, **extra) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/chat/completions", headers=headers or {}, timeout=30,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], **extra})


# ----------------------------------------------------------------------------- routing, every API


def _ask(url: str, api: str, model: str) -> tuple[str, str]:
    """(the reported model, the reply text) of one request to `api` naming `model`."""
    messages = [{"role": "user", "content": "hi"}]
    if api == "chat":
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": messages, "temperature": 0},
                       timeout=30)
        return r.json()["model"], r.json()["choices"][0]["message"]["content"]
    if api == "completions":
        r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 64, "temperature": 0},
                       timeout=30)
        return r.json()["model"], r.json()["choices"][0]["text"]
    if api == "responses":
        r = httpx.post(f"{url}/v1/responses", json={"model": model, "input": "hi", "temperature": 0}, timeout=30)
        return r.json()["model"], r.json()["output"][-1]["content"][0]["text"]
    if api == "messages":
        r = httpx.post(f"{url}/v1/messages", json={"model": model, "max_tokens": 64, "messages": messages,
                                                    "temperature": 0}, timeout=30)
        return r.json()["model"], r.json()["content"][0]["text"]
    if api == "ollama_chat":
        r = httpx.post(f"{url}/api/chat", json={"model": model, "messages": messages, "stream": False,
                                                   "options": {"temperature": 0}}, timeout=30)
        return r.json()["model"], r.json()["message"]["content"]
    r = httpx.post(f"{url}/api/generate", json={"model": model, "prompt": "hi", "stream": False,
                                                   "options": {"temperature": 0}}, timeout=30)
    return r.json()["model"], r.json()["response"]


APIS = ("chat", "completions", "responses", "messages", "ollama_chat", "ollama_generate")


@pytest.mark.parametrize("api", APIS)
def test_an_adapter_name_runs_its_base_through_the_adapter(srv, api):
    assert _ask(srv.url, api, "sql") == ("sql", f"[sql] {REPLY}")
    assert _ask(srv.url, api, MODEL) == (MODEL, REPLY)  # the base: no adapter


def test_the_engine_is_given_the_adapter_name_and_nothing_for_the_base(srv):
    before = dict(srv.core.lora_requests)
    r = chat(srv, "sql")
    assert r.status_code == 200 and r.headers["x-tessera-model"] == MODEL
    chat(srv, "alias")
    new = {rid: lora for rid, lora in srv.core.lora_requests.items() if rid not in before}
    assert sorted(new.values(), key=str) == [None, "sql"]


def test_a_streamed_chat_reports_the_adapter(srv):
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=30,
                      json={"model": "sql", "stream": True, "temperature": 0,
                            "messages": [{"role": "user", "content": "hi"}]}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert {c["model"] for c in chunks} == {"sql"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == f"[sql] {REPLY}"


def test_an_unknown_adapter_is_a_404_in_each_apis_shape(srv):
    r = chat(srv, "nosuch")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{srv.url}/v1/messages", json={"model": "nosuch", "max_tokens": 8,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    for path, body in (("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}), ("/api/generate", {"prompt": "x"})):
        r = httpx.post(f"{srv.url}{path}", json={"model": "nosuch", "stream": False, **body})
        assert r.status_code == 404 and "nosuch" in r.json()["error"]


def test_tokenize_with_an_adapters_name_uses_the_base_tokenizer(srv):
    r = httpx.post(f"{srv.url}/tokenize", json={"model": "sql", "prompt": "hi"})
    assert r.status_code == 200 and r.json()["tokens"] == list(b"hi")


def test_embeddings_refuse_an_adapter(srv):
    r = httpx.post(f"{srv.url}/v1/embeddings", json={"model": "sql", "input": "hi"})
    assert r.status_code == 400 and "embeddings do not take LoRA adapters" in r.json()["error"]["message"]


# ----------------------------------------------------------------------------- listing


def test_models_list_adapters_with_their_parent(srv):
    cards = {c["id"]: c for c in httpx.get(f"{srv.url}/v1/models").json()["data"]}
    assert cards[MODEL]["parent"] is None and cards["alias"]["parent"] is None
    sql = cards["sql"]
    assert (sql["object"], sql["parent"], sql["owned_by"]) == ("model", MODEL, "tessera")
    assert sql["root"].endswith("sql") and isinstance(sql["created"], int)
    one = httpx.get(f"{srv.url}/v1/models/sql")
    assert one.status_code == 200 and one.json() == sql
    assert httpx.get(f"{srv.url}/v1/models/{MODEL}").json()["parent"] is None
    missing = httpx.get(f"{srv.url}/v1/models/nosuch")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_ollama_tags_list_adapters_with_their_parent_model(srv):
    tags = {m["name"]: m for m in httpx.get(f"{srv.url}/api/tags").json()["models"]}
    assert tags["sql"]["details"]["parent_model"] == MODEL and tags[MODEL]["details"]["parent_model"] == ""


def test_the_dashboards_endpoint_names_the_adapters(srv):
    (m,) = httpx.get(f"{srv.url}/v1/engine/live").json()["models"]
    assert m["adapters"] == ["sql"] and m["settings"]["max_loras"] == 1
    assert m["current"]["lora_running"] == {} and m["current"]["lora_waiting"] == {}


# ----------------------------------------------------------------------------- load and unload


def test_load_serve_unload_an_adapter(srv, tmp_path):
    path = write_peft(tmp_path / "poet")
    r = load(srv, "poet", path)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'poet' added successfully.")
    assert core_sees(srv, lambda loras: "poet" in loras and loras["poet"].rank == 4)  # given the checked spec
    assert _ask(srv.url, "chat", "poet") == ("poet", f"[poet] {REPLY}")
    cards = {c["id"]: c for c in httpx.get(f"{srv.url}/v1/models").json()["data"]}
    assert cards["poet"]["parent"] == MODEL and cards["poet"]["root"] == str(path)

    r = load(srv, "poet", path)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "The lora adapter 'poet' has already been loaded."

    r = unload(srv, "poet")
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'poet' removed successfully.")
    assert core_sees(srv, lambda loras: "poet" not in loras)
    r = chat(srv, "poet")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = unload(srv, "poet")
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'poet' cannot be found."


def test_unload_an_adapter_served_from_start_up_then_load_it_again(tmp_path):
    with lora_server(tmp_path) as s:
        assert unload(s, "sql").status_code == 200
        assert chat(s, "sql").status_code == 404
        assert "sql" not in {c["id"] for c in httpx.get(f"{s.url}/v1/models").json()["data"]}
        assert load(s, "sql", tmp_path / "sql").status_code == 200
        assert _ask(s.url, "chat", "sql") == ("sql", f"[sql] {REPLY}")


@pytest.mark.parametrize("case, needle", [
    ("missing", "does not exist"),
    ("not_an_adapter", "neither a PEFT folder"),
    ("other_model", "trained for another model"),
    ("rank", "--max-lora-rank"),
])
def test_a_bad_adapter_is_a_400_saying_why(srv, tmp_path, case, needle):
    path = {"missing": lambda: tmp_path / "nowhere",
            "not_an_adapter": lambda: (tmp_path / "notes.txt").write_text("hi") and tmp_path / "notes.txt",
            "other_model": lambda: write_peft(tmp_path / "big", hidden=16, q_out=16),
            "rank": lambda: write_peft(tmp_path / "wide", rank=32)}[case]()
    r = load(srv, "bad", path)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert needle in r.json()["error"]["message"]
    assert chat(srv, "bad").status_code == 404


def test_load_refuses_taken_names_bad_bodies_and_adapter_bases(srv, tmp_path):
    path = write_peft(tmp_path / "a")
    for name in (MODEL, "alias"):
        r = load(srv, name, path)
        assert r.status_code == 400 and "name of a served model" in r.json()["error"]["message"]
    assert load(srv, " spaced", path).status_code == 400
    r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = load(srv, "x", path, base_model_name="sql")
    assert r.status_code == 400 and "is a LoRA adapter" in r.json()["error"]["message"]
    r = load(srv, "x", path, base_model_name="nosuch")
    assert r.status_code == 404
    assert load(srv, "x", path, base_model_name="alias").status_code == 200  # an alias names the base
    assert unload(srv, "x").status_code == 200


def test_load_needs_lora_enabled(tmp_path):
    with lora_server(tmp_path, enable_lora=False) as s:
        r = load(s, "poet", write_peft(tmp_path / "poet"))
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
        assert chat(s, "poet").status_code == 404


# ----------------------------------------------------------------------------- keys


def test_load_and_unload_need_the_admin_scope_and_keys_lists_name_adapters(tmp_path):
    with lora_server(tmp_path, keys=KEYS) as s:
        path = write_peft(tmp_path / "poet")
        for call in (lambda h: load(s, "poet", path, h), lambda h: unload(s, "sql", h)):
            assert call({}).status_code == 401
            assert call(APP_H).status_code == 403
        assert load(s, "poet", path, ADMIN_H).status_code == 200
        assert unload(s, "poet", ADMIN_H).status_code == 200

        sql_only, base_only = bearer(SQL_ONLY_KEY), bearer(BASE_ONLY_KEY)
        assert chat(s, "sql", sql_only).status_code == 200
        r = chat(s, MODEL, sql_only)
        assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
        r = chat(s, "sql", base_only)  # the base's name does not allow its adapters
        assert r.status_code == 403 and "`sql`" in r.json()["error"]["message"]
        assert chat(s, MODEL, base_only).status_code == 200
        assert [c["id"] for c in httpx.get(f"{s.url}/v1/models", headers=sql_only).json()["data"]] == ["sql"]
        assert "sql" not in {c["id"] for c in httpx.get(f"{s.url}/v1/models", headers=base_only).json()["data"]}
        assert httpx.get(f"{s.url}/v1/models/sql", headers=base_only).status_code == 404


# ----------------------------------------------------------------------------- the router


def test_a_lazy_models_adapters_route_before_it_loads_and_runtime_ones_survive_a_reload():
    built: list[AsyncLLMEngine] = []

    def build(served: ServedModel) -> AsyncLLMEngine:
        built.append(fake_engine())
        return built[-1]

    served = ServedModel(ModelSpec("base", "m"), lora_modules=(LoRAModule("sql", "/adapters/sql"),))
    router = ModelRouter([served], builder=build, closer=lambda s: None)
    try:
        assert router.lookup("sql") == (served, "sql") and router.lookup("base") == (served, None)
        router.load(served)
        spec = type("Spec", (), {"name": "poet", "path": "/adapters/poet"})()
        router.add_adapter(served, spec)
        router.remove_adapter("sql")
        assert served.adapters() == {"poet": "/adapters/poet"}
        router.unload(served, "test")
        assert router.lookup("poet") == (served, "poet")  # still served: it comes back with the model
        router.load(served)
        assert built[-1].lora_adapters() == [spec]  # the rebuilt engine was given it again
        with pytest.raises(Exception, match="cannot be found"):
            router.remove_adapter("sql")
    finally:
        router.shutdown()
        for engine in built:
            engine.shutdown()


def test_adapter_names_must_not_clash_with_models():
    with pytest.raises(ValueError, match="already a model name"):
        ModelRouter([ServedModel(ModelSpec("a", "m")),
                     ServedModel(ModelSpec("b", "m"), lora_modules=(LoRAModule("a", "/p"),))])
    with pytest.raises(ValueError, match="an adapter of 'a'"):
        ModelRouter([ServedModel(ModelSpec("a", "m"), lora_modules=(LoRAModule("x", "/p"),)),
                     ServedModel(ModelSpec("b", "m"), lora_modules=(LoRAModule("x", "/q"),))])


# ----------------------------------------------------------------------------- configuration


def test_lora_flags_and_toml_reach_each_models_engine_config(tmp_path):
    spec = serving_spec("smollm2-135m", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "2")
    config = spec.engine_config(spec.models[0])
    assert [m.name for m in config.lora_modules] == ["sql", "chat"] and config.enable_lora and config.max_loras == 2
    toml = tmp_path / "models.toml"
    toml.write_text('''
[[model]]
name = "coder"
model = "qwen2.5-coder-0.5b"
lora_modules = ["sql=/a/sql", {name = "docs", path = "/a/docs"}]
[[model]]
name = "small"
model = "smollm2-135m"
[model.engine]
lora_modules = ["poet=/a/poet"]
max_lora_rank = 64
''')
    spec = serving_spec("--config", str(toml))
    coder, small = (spec.engine_config(m) for m in spec.models)
    assert [(m.name, m.path) for m in coder.lora_modules] == [("sql", "/a/sql"), ("docs", "/a/docs")]
    assert [m.name for m in small.lora_modules] == ["poet"] and small.max_lora_rank == 64 and small.enable_lora
    for bad, needle in (('[[model]]\nname = "a"\nmodel = "m"\nlora_modules = ["a=/p"]', "has the name of the served model"),
                        ('[[model]]\nname = "a"\nmodel = "m"\nlora_modules = ["x=/p"]\n'
                         '[[model]]\nname = "b"\nmodel = "m"\nlora_modules = ["x=/q"]', "served by models 'a' and 'b'"),
                        ('[[model]]\nmodel = "m"\nlora_modules = "x=/p"', "must be a list"),
                        ('[[model]]\nmodel = "m"\nlora_modules = ["x=/p"]\n[model.engine]\nlora_modules = ["y=/q"]',
                         "set twice")):
        toml.write_text(bad)
        with pytest.raises(TesseraError, match=needle):
            serving_spec("--config", str(toml))


# ----------------------------------------------------------------------------- metrics


def _lora_lines(families: MetricFamilies) -> list[str]:
    return [line for line in families.render()[0].decode().splitlines()
            if line.startswith("tessera:lora_requests_info{")]


def test_lora_requests_info_names_running_and_waiting_adapters():
    families = MetricFamilies()
    logger = PrometheusStatLogger(MODEL, families=families)
    logger.record(SchedulerStats(), None)
    assert _lora_lines(families) == []  # only exported with LoRA enabled
    logger.enable_lora_info(4)
    logger.record(SchedulerStats(num_running=2, lora_running={"sql": 1, "chat": 1}, lora_waiting={"poet": 3}), None)
    (line,) = _lora_lines(families)
    for label in (f'model_name="{MODEL}"', 'running_lora_adapters="chat,sql"', 'waiting_lora_adapters="poet"',
                  'max_lora="4"'):
        assert label in line
    assert float(line.rsplit(" ", 1)[1]) > 1.7e9  # the time of the update
    logger.record(SchedulerStats(), None)
    (line,) = _lora_lines(families)  # the old label set is gone
    assert 'running_lora_adapters=""' in line and 'waiting_lora_adapters=""' in line
