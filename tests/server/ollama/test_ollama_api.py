"""Ollama's API and vLLM's /tokenize and /detokenize, driven by the official `ollama` client and raw HTTP.

The tiny random model runs the real engine in seconds (formats, streamed against whole answers,
options, keep_alive, hostile bodies); the scripted FakeCore of fakes.py covers the
router's keep_alive and the 429 path. The real packaged models are in test_ollama_real.py.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Iterator

import httpx
import ollama
import pytest
from fastapi.testclient import TestClient
from fakes import fake_engine
from fakes import FakeCore, live_server, serve_in_thread
from tiny_model import make_tiny_model

from tessera.config import EngineConfig
from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.engine.outputs import CompletionOutput, RequestOutput
from tessera.server.app import create_app
from tessera.server.ollama.reply import OllamaReply, Timing
from tessera.server.model_router import ModelRouter
from tessera.server.served_model import ModelSpec, ServedModel
from tessera.server.tools import OutputParsing, output_parser

NAME = "tiny"
MAX_LEN = 256
GREEDY = {"temperature": 0, "num_predict": 8}


class Tiny:
    def __init__(self, url: str, engine: AsyncLLMEngine) -> None:
        self.url = url
        self.engine = engine
        self.client = ollama.Client(host=url, timeout=60)

    def post(self, path: str, body) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=60)

    def tokens(self, **body) -> list[int]:
        r = self.post("/tokenize", {"model": NAME, **body})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Iterator[Tiny]:
    from tessera.models.loader import load_model

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", max_positions=MAX_LEN)
    config = EngineConfig(model=str(folder), dtype="float32", max_model_len=MAX_LEN, max_num_seqs=8,
                          kv_cache_memory=256 * 2 * 2 * 2 * 16 * 4 * 16)
    engine = AsyncLLMEngine(config, engine=LLMEngine(config, loaded=load_model(folder, "float32")),
                            max_num_queued_requests=24)
    try:
        with serve_in_thread(create_app(engine, [NAME])) as url:
            yield Tiny(url, engine)
    finally:
        engine.shutdown()


def wait_idle(srv: Tiny, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{srv.url}/v1/engine/stats").json()
        s = stats["scheduler"]
        if (s["num_running"], s["num_waiting"], stats["server"]["active_requests"]) == (0, 0, 0) \
                and s["kv_cache_usage"] == 0:
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def assert_stats(r) -> None:
    """The final object's statistics: Ollama's names, integer nanoseconds, consistent."""
    for key in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                "eval_duration"):
        assert isinstance(r[key], int) and r[key] >= 0, (key, r[key])
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration
    assert r.prompt_eval_count > 0 and r.done and r.done_reason in ("stop", "length")


# ----------------------------------------------------------------------------- the ollama client


def test_list_show_ps_version(tiny):
    listed = tiny.client.list()
    assert [m.model for m in listed.models] == [NAME]
    assert listed.models[0].details.family == "llama" and listed.models[0].size > 0
    shown = tiny.client.show(NAME)
    assert shown.capabilities == ["completion", "tools"] and "im_start" in shown.template
    assert shown.modelinfo["llama.context_length"] == MAX_LEN and shown.modelinfo["llama.block_count"] == 2
    assert shown.modelinfo["llama.vocab_size"] == tiny.engine.model_config.vocab_size
    running = tiny.client.ps().models
    assert [m.model for m in running] == [NAME] and running[0].context_length == MAX_LEN
    assert running[0].expires_at.year > 2200  # handed-in engine: kept loaded for ever
    assert httpx.get(f"{tiny.url}/api/version").json()["version"].count(".") == 2
    # the chat page stays at / (HEAD / answers 200 as Ollama's probes expect)
    assert httpx.head(f"{tiny.url}/").status_code == 200
    assert "text/html" in httpx.get(f"{tiny.url}/").headers["content-type"]
    assert tiny.client.show(NAME + ":latest").capabilities  # Ollama's implicit tag


def test_root_says_ollama_is_running_without_the_chat_page(tiny):
    client = TestClient(create_app(tiny.engine, [NAME], ui=False))
    r = client.get("/")
    assert r.status_code == 200 and r.text == "Ollama is running"
    assert client.head("/").status_code == 200


def test_chat_streamed_matches_whole_and_counts_the_template(tiny):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    whole = tiny.client.chat(model=NAME, messages=messages, options=GREEDY)
    parts = list(tiny.client.chat(model=NAME, messages=messages, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].message.content == ""
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert whole.message.role == "assistant" and whole.done_reason == "length" and whole.eval_count == 8
    for r in (whole, parts[-1]):
        assert_stats(r)
        assert r.prompt_eval_count == len(tiny.tokens(messages=messages))
    wait_idle(tiny)


def test_generate_streamed_matches_whole_raw_system_and_context(tiny):
    whole = tiny.client.generate(model=NAME, prompt="the quick brown", options=GREEDY)
    parts = list(tiny.client.generate(model=NAME, prompt="the quick brown", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == whole.response and parts[-1].done
    assert_stats(whole)
    templated = tiny.tokens(messages=[{"role": "user", "content": "the quick brown"}])
    assert whole.prompt_eval_count == len(templated)
    assert list(whole.context)[:len(templated)] == templated and len(whole.context) == len(templated) + 8
    raw = tiny.client.generate(model=NAME, prompt="the quick brown", raw=True, options=GREEDY)
    assert raw.prompt_eval_count == len(tiny.tokens(prompt="the quick brown"))
    system = tiny.client.generate(model=NAME, prompt="the quick brown", system="be brief", options=GREEDY)
    assert system.prompt_eval_count == len(tiny.tokens(messages=[{"role": "system", "content": "be brief"},
                                                                 {"role": "user", "content": "the quick brown"}]))
    more = tiny.client.generate(model=NAME, prompt="fox", context=whole.context, options=GREEDY)
    assert more.prompt_eval_count == len(whole.context) + len(tiny.tokens(
        messages=[{"role": "user", "content": "fox"}]))
    wait_idle(tiny)


def test_options_map_onto_sampling(tiny):
    def gen(**options) -> ollama.GenerateResponse:
        return tiny.client.generate(model=NAME, prompt="hello", options=options)

    a, b = gen(temperature=1.0, seed=7, num_predict=12), gen(temperature=1.0, seed=7, num_predict=12)
    assert a.response == b.response  # seeded sampling reproduces
    free = gen(temperature=0, num_predict=6).response
    stop = free[2:4]
    if stop.strip():
        assert stop not in gen(temperature=0, num_predict=6, stop=[stop]).response
    # num_predict past the context is cut to what the context leaves, as Ollama generates until full
    prompt_len = a.prompt_eval_count
    huge = gen(temperature=0, num_predict=10**12, repeat_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5,
               top_k=5, top_p=0.5, min_p=0.1)
    assert huge.eval_count <= MAX_LEN - prompt_len
    assert huge.done_reason == "stop" or huge.eval_count == MAX_LEN - prompt_len
    small_ctx = gen(temperature=0, num_predict=100, num_ctx=prompt_len + 5, ignored_option=True, mirostat=2)
    assert small_ctx.eval_count <= 5
    wait_idle(tiny)


def test_format_json_schema_and_logprobs(tiny):
    schema = {"type": "object", "properties": {"a": {"type": "string", "enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    r = tiny.client.generate(model=NAME, prompt="json please", format=schema, options={"num_predict": 60,
                                                                                    "temperature": 0})
    assert json.loads(r.response)["a"] in ("x", "y") and r.done_reason == "stop"
    r = tiny.client.chat(model=NAME, messages=[{"role": "user", "content": "json"}], format="json",
                         options={"num_predict": 4, "temperature": 0}, logprobs=True, top_logprobs=3)
    assert r.message.content.lstrip().startswith("{")
    assert len(r.logprobs) == r.eval_count and all(len(lp.top_logprobs) == 3 for lp in r.logprobs)
    assert "".join(lp.token for lp in r.logprobs) == r.message.content


def test_a_handed_in_engine_stays_loaded_whatever_keep_alive_says(tiny):
    r = tiny.post("/api/generate", {"model": NAME, "keep_alive": 0})
    assert r.status_code == 400 and "stays loaded" in r.json()["error"]
    r = tiny.post("/api/chat", {"model": NAME, "messages": []})
    assert r.status_code == 200 and r.json()["done_reason"] == "load"
    r = tiny.post("/api/generate", {"model": NAME, "prompt": "hi", "keep_alive": 0, "stream": False,
                                    "options": {"num_predict": 2}})
    assert r.status_code == 200 and tiny.client.ps().models


# ----------------------------------------------------------------------------- tool calls, parsed


def _outputs(text: str, cuts: list[int]) -> list[RequestOutput]:
    """`text` as the engine would stream it, cut at `cuts`, the last piece finished."""
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    outs, sofar = [], ""
    for k, piece in enumerate(pieces):
        sofar += piece
        last = k == len(pieces) - 1
        outs.append(RequestOutput("r", None, [1, 2], [CompletionOutput(
            0, text=sofar, delta_text=piece, token_ids=[3] * (k + 1), finish_reason="stop" if last else None)],
            finished=last))
    return outs


def test_streamed_tool_calls_come_whole_and_agree_with_the_whole_answer():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    whole = OllamaReply("chat", "m", Timing(time.perf_counter_ns()), output_parser(OutputParsing(), True), False).whole(_outputs(text, [])[-1])
    calls = whole["message"]["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {})]
    assert whole["message"]["content"] == "Let me check." and whole["done_reason"] == "stop"
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), 8))
        reply = OllamaReply("chat", "m", Timing(time.perf_counter_ns()), output_parser(OutputParsing(), True), False)
        lines = [json.loads(line) for out in _outputs(text, cuts) for line in reply.render(0, out)]
        streamed = [c for line in lines for c in line["message"].get("tool_calls", [])]
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]
        assert "".join(line["message"]["content"] for line in lines) == "Let me check."


def test_a_call_whose_arguments_are_not_an_object_stays_text():
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>'
    whole = OllamaReply("chat", "m", Timing(time.perf_counter_ns()), output_parser(OutputParsing(), True), False).whole(_outputs(text, [])[-1])
    assert "tool_calls" not in whole["message"]
    assert whole["message"]["content"] == 'Sure.{"name": "f", "arguments": [1, 2]}'


# ----------------------------------------------------------------------------- /tokenize and /detokenize


def test_tokenize_round_trips_prompts_and_chat_messages(tiny):
    text = "the quick brown fox, café 日本語 🙂"
    r = tiny.post("/tokenize", {"model": NAME, "prompt": text, "return_token_strs": True}).json()
    assert set(r) == {"count", "max_model_len", "tokens", "token_strs"}
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == MAX_LEN
    assert tiny.post("/detokenize", {"model": NAME, "tokens": r["tokens"]}).json() == {"prompt": text}
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": text}]
    ids = tiny.tokens(messages=messages)
    rendered = tiny.engine.tokenizer.apply_chat_template(messages)
    assert tiny.post("/detokenize", {"tokens": ids}).json()["prompt"] == rendered  # special tokens kept
    assert len(tiny.tokens(messages=messages, add_generation_prompt=False)) < len(ids)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    assert len(tiny.tokens(messages=messages, tools=tools)) > len(ids)  # tools in the system turn
    # longer than the context: counted, not refused
    long = tiny.post("/tokenize", {"prompt": "the quick brown fox " * 200}).json()
    assert long["count"] > MAX_LEN


# ----------------------------------------------------------------------------- hostile bodies

OLLAMA_ERRORS = [
    ("/api/chat", b"", 400), ("/api/chat", b"{", 400), ("/api/chat", b"[]", 400),
    ("/api/chat", {"messages": [{"role": "user", "content": "x"}]}, 400),  # no model
    ("/api/chat", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ("/api/chat", {"model": NAME, "messages": "hi"}, 400),
    ("/api/chat", {"model": NAME, "messages": [{"content": "x"}]}, 400),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": 5}]}, 400),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "think": True}, 400),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "format": "yaml"}, 400),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "format": "json",
                   "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                   "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "options": {"temperature": "hot"}},
     400),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "options": {"temperature": -1}},
     400),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "options": {"num_predict": 1e30}},
     400),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                   "options": {"num_predict": 10**30}}, 400),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "options": {"num_ctx": 0}}, 400),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "options": "fast"}, 400),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "keep_alive": "soon"}, 400),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 50}, 400),
    ("/api/chat", {"model": NAME, "messages": [{"role": "user", "content": "x" * 5000}]}, 400),  # > context
    ("/api/generate", b"", 400), ("/api/generate", {"model": NAME, "prompt": 7}, 400),
    ("/api/generate", {"model": "nope", "prompt": "x"}, 404),
    ("/api/generate", {"model": NAME, "prompt": "x", "context": [-1]}, 400),
    ("/api/generate", {"model": NAME, "prompt": "x", "context": [10**9]}, 400),
    ("/api/generate", {"model": NAME, "prompt": "x", "context": [2**70]}, 400),
    ("/api/generate", {"model": NAME, "prompt": "x", "context": "abc"}, 400),
    ("/api/generate", {"model": NAME, "prompt": "x", "template": "{{ .Prompt }}"}, 400),
    ("/api/generate", {"model": NAME, "prompt": "x", "suffix": "y"}, 400),
    ("/api/generate", {"model": NAME, "prompt": "x", "options": {"stop": 3}}, 400),
    ("/api/generate", {"model": NAME, "prompt": "x", "options": {"seed": True}}, 400),
    ("/api/generate", {"model": NAME, "prompt": "x", "raw": "yes"}, 400),
    ("/api/generate", {"model": NAME, "prompt": "x", "stream": False, "options": {"num_ctx": 2}}, 400),
    ("/api/show", b"", 400), ("/api/show", {}, 400), ("/api/show", {"model": "nope"}, 404),
    ("/api/show", {"model": 3}, 400),
]


@pytest.mark.parametrize("path,body,status", OLLAMA_ERRORS)
def test_hostile_ollama_bodies_are_4xx_in_ollama_shape(tiny, path, body, status):
    for stream in (True, False):
        if isinstance(body, dict):
            body = {**body, "stream": body.get("stream", stream)}
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(f"{tiny.url}{path}", timeout=30, **kw)
        assert r.status_code == status, r.text
        payload = r.json()
        assert set(payload) == {"error"} and isinstance(payload["error"], str) and payload["error"], payload


TOKENIZE_ERRORS = [
    ("/tokenize", b"", 400), ("/tokenize", {}, 400), ("/tokenize", {"prompt": 5}, 400),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400),
    ("/tokenize", {"messages": []}, 400), ("/tokenize", {"messages": [{"role": "user"}], "tools": "x"}, 400),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, 400),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404),
    ("/detokenize", b"", 400), ("/detokenize", {}, 400), ("/detokenize", {"tokens": "abc"}, 400),
    ("/detokenize", {"tokens": [1.5]}, 400), ("/detokenize", {"tokens": [-1]}, 400),
    ("/detokenize", {"tokens": [10**9]}, 400), ("/detokenize", {"tokens": [2**70]}, 400),
    ("/detokenize", {"tokens": [True]}, 400), ("/detokenize", {"model": "nope", "tokens": [1]}, 404),
]


@pytest.mark.parametrize("path,body,status", TOKENIZE_ERRORS)
def test_hostile_tokenize_bodies_are_4xx_in_openai_shape(tiny, path, body, status):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{tiny.url}{path}", timeout=30, **kw)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_ollama_errors_surface_in_the_client(tiny):
    with pytest.raises(ollama.ResponseError) as info:
        tiny.client.chat(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 404 and "not found" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        list(tiny.client.generate(model=NAME, prompt="x", stream=True, options={"temperature": -2}))
    assert info.value.status_code == 400 and "temperature" in info.value.error
    wait_idle(tiny)


# ----------------------------------------------------------------------------- the router: keep_alive, 429


def test_keep_alive_unloads_after_the_request_and_load_requests():
    closed: list[str] = []
    models = [ServedModel(ModelSpec("a", "m")), ServedModel(ModelSpec("b", "m", keep_alive=600))]
    router = ModelRouter(models, builder=lambda served: fake_engine(), closer=lambda s: closed.append(s.name))
    router.start_reaper(interval_s=0.05)
    a = models[0]

    def wait_status(status: str) -> None:
        deadline = time.monotonic() + 5
        while a.status != status and time.monotonic() < deadline:
            time.sleep(0.02)
        assert a.status == status

    try:
        with serve_in_thread(create_app(router=router)) as url:
            client = ollama.Client(host=url, timeout=30)
            assert client.ps().models == []
            r = client.generate(model="a", prompt="hi", keep_alive=0, options={"num_predict": 3})
            assert r.done and r.load_duration > 0  # it waited for the model to load
            wait_status("unloaded")
            assert closed == ["a"] and a.keep_alive is None  # a request's keep_alive lasts one loaded session
            # a request without keep_alive restores the configured one (never, for a)
            client.chat(model="a", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2})
            time.sleep(0.3)
            assert a.status == "ready" and a.keep_alive is None
            client.chat(model="a", messages=[{"role": "user", "content": "hi"}], keep_alive="30m",
                        options={"num_predict": 2})
            (only,) = [m for m in client.ps().models if m.model == "a"]
            remaining = (only.expires_at.timestamp() - time.time())
            assert 1700 < remaining <= 1800
            # an empty request unloads with keep_alive 0 and loads without
            r = httpx.post(f"{url}/api/generate", json={"model": "a", "keep_alive": 0}).json()
            assert r["done_reason"] == "unload" and a.status == "unloaded"
            r = httpx.post(f"{url}/api/chat", json={"model": "a", "messages": [], "keep_alive": "-1"}).json()
            assert r["done_reason"] == "load" and a.status == "ready" and a.keep_alive is None
            assert r["message"] == {"role": "assistant", "content": ""}
            assert [m.model for m in client.ps().models] == ["a"]
            assert httpx.get(f"{url}/v1/engine/stats").json()["models"][0]["keep_alive_s"] is None
    finally:
        router.shutdown()


def test_keep_alive_zero_does_not_unload_a_model_a_request_has_just_chosen():
    model = ServedModel(ModelSpec("a", "m"))
    router = ModelRouter([model], builder=lambda served: fake_engine(), closer=lambda served: None)
    try:
        asyncio.run(router.route("a"))  # chosen; its prompt is not with the engine yet
        model.keep_alive = 0  # what an earlier request's keep_alive 0 left
        router.start_reaper(interval_s=0.05)
        time.sleep(0.5)  # many reaper rounds
        assert model.status == "ready"
        deadline = time.monotonic() + 5
        while model.status != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert model.status == "unloaded"
    finally:
        router.shutdown()


def test_queue_full_is_429_in_ollama_shape():
    core = FakeCore(step_s=0.02, max_num_seqs=1)
    with live_server(core, max_num_queued_requests=2) as s:
        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as client:
                return await asyncio.gather(*[
                    client.post("/api/generate", json={"model": "fake-model", "prompt": "x", "stream": i % 2 == 0,
                                                       "options": {"num_predict": 5}})
                    for i in range(12)])

        responses = asyncio.run(flood())
        statuses = [r.status_code for r in responses]
        assert statuses.count(429) >= 5 and statuses.count(200) >= 2, statuses
        for r in responses:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1" and "queue full" in r.json()["error"].lower()
            else:
                lines = [json.loads(line) for line in r.text.splitlines()] if "ndjson" in \
                    r.headers["content-type"] else [r.json()]
                assert lines[-1]["done"] and lines[-1]["eval_count"] == 5
        s.wait_idle()
