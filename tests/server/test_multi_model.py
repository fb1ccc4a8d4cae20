"""Several models behind one server: names and aliases, fallback rules, loading and unloading, config.

Fast tests with in-process fake engines (tests/fakes.py's FakeCore); the real-process
checks (two packaged models, engine crash isolation) are in tests/server/test_multi_model_real.py.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import re
import threading
import time
import weakref

import httpx
import pytest
from fakes import serve_in_thread

from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.errors import TesseraError
from tessera.server.app import create_app
from tessera.server.config import ServingSpec, parse_duration
from tessera.server.model_router import ModelRouter
from tessera.server.served_model import FallbackCondition, FallbackRule, ModelSpec, ServedModel
from fakes import fake_engine


def test_fallback_conditions_parse():
    assert FallbackCondition.parse("queue_full") == FallbackCondition("queue_full")
    assert FallbackCondition.parse(" queue_wait > 2s") == FallbackCondition("queue_wait", 2.0)
    assert FallbackCondition.parse("queue_wait>500ms") == FallbackCondition("queue_wait", 0.5)
    assert FallbackCondition.parse("kv_usage > 0.9") == FallbackCondition("kv_usage", 0.9)
    assert FallbackCondition.parse("unavailable").kind == "unavailable"
    with pytest.raises(ValueError, match="unknown fallback condition"):
        FallbackCondition.parse("queue_len > 3")
    assert str(FallbackCondition("queue_wait", 2.0)) == "queue_wait > 2s"


def test_durations():
    assert parse_duration("5m") == 300 and parse_duration("30s") == 30 and parse_duration("1h") == 3600
    assert parse_duration(90) == 90 and parse_duration("-1") is None and parse_duration(None) is None
    with pytest.raises(TesseraError):
        parse_duration("soon")


def test_router_rejects_bad_configurations():
    a = ServedModel(ModelSpec("a", "m", aliases=["x"]))
    with pytest.raises(ValueError, match="used twice"):
        ModelRouter([a, ServedModel(ModelSpec("x", "m"))])
    with pytest.raises(ValueError, match="not served"):
        ModelRouter([ServedModel(ModelSpec("a", "m", fallback=FallbackRule("zzz", (FallbackCondition("queue_full"),))))])
    with pytest.raises(ValueError, match="itself"):
        ModelRouter([ServedModel(ModelSpec("a", "m", aliases=["b"],
                                           fallback=FallbackRule("b", (FallbackCondition("queue_full"),))))])


def two_model_server(big: AsyncLLMEngine, small: AsyncLLMEngine, when: tuple[FallbackCondition, ...]):
    degraded: list[tuple[str, str, str]] = []
    router = ModelRouter([ServedModel(ModelSpec("big", "m", aliases=["large"], fallback=FallbackRule("small", when)), big),
                          ServedModel(ModelSpec("small", "m"), small)],
                         on_degraded=lambda *a: degraded.append(a))
    return router, degraded


def test_routes_by_name_and_alias_and_reports_who_answered():
    big, small = fake_engine(), fake_engine()
    router, _ = two_model_server(big, small, (FallbackCondition("queue_full"),))
    app = create_app(router=router)
    try:
        with serve_in_thread(app) as url:
            models = httpx.get(f"{url}/v1/models").json()["data"]
            assert [(m["id"], m["status"]) for m in models] == [("big", "ready"), ("large", "ready"),
                                                                 ("small", "ready")]
            for asked, answered in (("big", "big"), ("large", "big"), ("small", "small"), (None, "big")):
                body = {"prompt": "hi", "max_tokens": 3}
                if asked:
                    body["model"] = asked
                r = httpx.post(f"{url}/v1/completions", json=body)
                assert r.status_code == 200 and r.headers["x-tessera-model"] == answered
                assert r.json()["model"] == (asked or "big")  # an alias is reported as asked
                assert "x-tessera-fallback-cause" not in r.headers
            assert httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
            health = httpx.get(f"{url}/health").json()
            assert health == {"status": "ok", "models": {"big": "ready", "small": "ready"}}
            stats = httpx.get(f"{url}/v1/engine/stats", params={"model": "small"}).json()
            assert stats["model"] == "small" and [m["id"] for m in stats["models"]] == ["big", "small"]
    finally:
        big.shutdown()
        small.shutdown()


def test_saturated_model_falls_back_instead_of_429():
    # one at a time, two waiting at most; big's steps wait for `hold`, so however slowly a loaded
    # host sends the 16 requests, none of big's drains before the others have been routed
    hold = threading.Event()
    big = fake_engine(step_s=0.01, max_num_seqs=1, queue=2, hold=hold)
    small = fake_engine(step_s=0.001, max_num_seqs=8)
    router, degraded = two_model_server(big, small, (FallbackCondition("queue_full"),))
    app = create_app(router=router)
    try:
        with serve_in_thread(app) as url:
            async def flood(headers: dict) -> list[httpx.Response]:
                hold.clear()
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    tasks = [asyncio.create_task(client.post(
                        "/v1/chat/completions", headers=headers,
                        json={"model": "big", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 4, "stream": i % 2 == 1})) for i in range(16)]
                    # big holds at most its queue of 2 and its one running request: release it once
                    # the other 13 are answered (by small, or 429), or after 50 s for the assertions to say
                    # (a suite's earlier tests can leave a 2-core host slow enough that 10 s saw 5 routed)
                    until = time.monotonic() + 50
                    while sum(t.done() for t in tasks) < 13 and time.monotonic() < until:
                        await asyncio.sleep(0.02)
                    hold.set()
                    return list(await asyncio.gather(*tasks))

            responses = asyncio.run(flood({}))
            statuses = [r.status_code for r in responses]
            answered = [r.headers.get("x-tessera-model") for r in responses]
            assert statuses.count(429) == 0, statuses
            assert answered.count("small") >= 5 and answered.count("big") >= 1, answered
            for r in responses:
                if r.headers["x-tessera-model"] == "small":
                    assert r.headers["x-tessera-fallback-from"] == "big"
                    assert r.headers["x-tessera-fallback-cause"] == "queue_full"
                    if not r.headers["content-type"].startswith("text/event-stream"):
                        assert r.json()["model"] == "small"
            assert len(degraded) == answered.count("small") and set(degraded) == {("big", "small", "queue_full")}
            # A request may forbid it: then the saturated model says 429 as before.
            forbidden = asyncio.run(flood({"x-tessera-no-fallback": "1"}))
            codes = [r.status_code for r in forbidden]
            assert codes.count(429) >= 5 and all(r.headers.get("x-tessera-model", "big") == "big"
                                                 for r in forbidden), codes
    finally:
        big.shutdown()
        small.shutdown()


def test_forecast_wait_and_kv_usage_conditions():
    big, small = fake_engine(forecast=5.0), fake_engine()
    router, degraded = two_model_server(big, small, (FallbackCondition("queue_wait", 2.0),))
    try:
        route = asyncio.run(router.route("big"))
        assert route.model.name == "small" and route.cause == "queue_wait" and route.reported == "small"
        router.models[0].spec.fallback = FallbackRule("small", (FallbackCondition("queue_wait", 10.0),))
        assert asyncio.run(router.route("big")).model.name == "big"
        router.models[0].spec.fallback = FallbackRule("small", (FallbackCondition("kv_usage", -1.0),))
        assert asyncio.run(router.route("big")).cause == "kv_usage"
    finally:
        big.shutdown()
        small.shutdown()


def test_lazy_load_keep_alive_and_lru_unload():
    built: list[str] = []
    closed: list[str] = []
    gate = threading.Event()

    def build(served: ServedModel) -> AsyncLLMEngine:
        built.append(served.name)
        if served.name == "slow":
            gate.wait(10)
        return fake_engine()

    models = [ServedModel(ModelSpec("a", "m", keep_alive=0.3)), ServedModel(ModelSpec("b", "m")),
              ServedModel(ModelSpec("slow", "m", fallback=FallbackRule("b", (FallbackCondition("unavailable"),))))]
    router = ModelRouter(models, builder=build, closer=lambda s: closed.append(s.name), max_loaded=2)
    try:
        assert [m.status for m in models] == ["unloaded"] * 3
        assert asyncio.run(router.route("a")).model.engine is not None and built == ["a"]
        asyncio.run(router.route("b"))
        assert [m.status for m in models] == ["ready", "ready", "unloaded"]
        # `slow` is loading: its rule sends requests to b meanwhile, and loading it makes room by
        # unloading the least recently used idle model (a; b was just used... both idle, a older).
        for m in models:
            m.last_used -= 10
        models[1].last_used += 5
        route = asyncio.run(router.route("slow"))
        assert route.model.name == "b" and route.cause == "unavailable"
        deadline = time.monotonic() + 5
        while models[0].status != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert models[0].status == "unloaded" and closed == ["a"]
        gate.set()
        models[2].load_event.wait(5)
        assert models[2].status == "ready" and asyncio.run(router.route("slow")).model.name == "slow"
        # keep_alive: a, reloaded, is unloaded again once idle past 0.3 s.
        router.max_loaded = None
        asyncio.run(router.route("a"))
        router.start_reaper(interval_s=0.05)
        deadline = time.monotonic() + 5
        while models[0].status != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert models[0].status == "unloaded" and closed == ["a", "a"] and models[1].status == "ready"
    finally:
        router.shutdown()


def test_unloading_frees_an_engine_held_in_reference_cycles():
    """"unloaded" promises the memory is free: an in-process engine holds its model in reference
    cycles, so the unload collects them rather than leave the weights to the collector's next
    full pass (automatic collection is off here, so nothing else frees it)."""
    engines: list[weakref.ref] = []

    def build(served: ServedModel) -> AsyncLLMEngine:
        engine = fake_engine()
        engine.itself = engine  # the cycle a real engine's parts make through its bound methods
        engines.append(weakref.ref(engine))
        return engine

    model = ServedModel(ModelSpec("a", "m"))
    router = ModelRouter([model], builder=build, closer=lambda s: None)
    gc.disable()
    try:
        asyncio.run(router.route("a"))
        assert engines[0]() is not None
        router.unload(model, "test")
        assert model.status == "unloaded" and engines[0]() is None
    finally:
        gc.enable()
        router.shutdown()


def test_a_model_that_fails_to_load_is_503_and_others_serve():
    def build(served: ServedModel) -> AsyncLLMEngine:
        if served.name == "broken":
            raise TesseraError("no such weights")
        return fake_engine()

    router = ModelRouter([ServedModel(ModelSpec("ok", "m")), ServedModel(ModelSpec("broken", "m"))], builder=build)
    app = create_app(router=router)
    try:
        with serve_in_thread(app) as url:
            r = httpx.post(f"{url}/v1/completions", json={"model": "broken", "prompt": "x"})
            assert r.status_code == 503 and "no such weights" in r.json()["error"]["message"]
            assert httpx.post(f"{url}/v1/completions", json={"model": "ok", "prompt": "x"}).status_code == 200
            health = httpx.get(f"{url}/health")
            assert health.status_code == 503 and health.json()["models"]["ok"] == "ready"
            assert httpx.get(f"{url}/health", params={"model": "ok"}).status_code == 200
    finally:
        router.shutdown()


def test_preloading_builds_in_the_calling_thread_and_raises_its_failure():
    """A server preloads on its main thread (a lone engine is built where it will step) and
    does not start when a preload fails."""
    threads = []

    def build(served: ServedModel):
        threads.append(threading.current_thread())
        if served.name == "bad":
            raise TesseraError("no such weights")
        return fake_engine()

    good, bad = ServedModel(ModelSpec("good", "m")), ServedModel(ModelSpec("bad", "m"))
    router = ModelRouter([good, bad], builder=build, closer=lambda s: None)
    try:
        router.load(good)
        assert good.status == "ready" and threads == [threading.current_thread()]
        with pytest.raises(TesseraError, match="no such weights"):
            router.load(bad)
        assert bad.status == "failed" and "no such weights" in bad.error
    finally:
        router.shutdown()


def serving_spec(*argv: str) -> ServingSpec:
    from tessera import cli

    parser = argparse.ArgumentParser()
    cli.add_serve_args(parser)
    return ServingSpec.from_args(parser.parse_args(list(argv)))


def test_specs_from_arguments_and_toml(tmp_path):
    spec = serving_spec("smollm2-135m", "qwen2.5-coder-0.5b", "--keep-alive", "5m", "--max-num-seqs", "4")
    specs = spec.models
    assert [(s.name, s.keep_alive, s.preload) for s in specs] == [("smollm2-135m", 300, False),
                                                                 ("qwen2.5-coder-0.5b", 300, False)]
    assert spec.engine_config(specs[1]).max_num_seqs == 4
    assert not spec.steps_on_main_thread  # several models: each engine loop on its own thread
    toml = tmp_path / "models.toml"
    toml.write_text('''
keep_alive = "10m"
max_loaded_models = 1
[[model]]
name = "coder"
model = "qwen2.5-coder-1.5b"
aliases = ["big"]
preload = true
fallback = "small"
when = ["queue_full", "queue_wait > 2s"]
max_num_queued_requests = 16
[model.engine]
max_num_seqs = 8
kv_cache_memory = "1GiB"
kv_cache_dtype = "int8"

[[model]]
name = "small"
model = "qwen2.5-coder-0.5b"
keep_alive = -1
''')
    spec = serving_spec("--config", str(toml), "--max-num-seqs", "2")
    coder, small = spec.models
    assert spec.max_loaded_models == 1
    assert serving_spec("--config", str(toml), "--max-loaded-models", "3").max_loaded_models == 3  # the flag wins
    assert (coder.name, coder.aliases, coder.preload, coder.keep_alive) == ("coder", ["big"], True, 600)
    assert coder.fallback == FallbackRule("small", (FallbackCondition("queue_full"), FallbackCondition("queue_wait", 2.0)))
    assert coder.engine_overrides == {"max_num_seqs": 8, "kv_cache_memory": 1 << 30, "kv_cache_dtype": "int8"}
    assert coder.max_num_queued_requests == 16 and small.keep_alive is None and small.fallback is None
    c = spec.engine_config(coder)
    assert (c.model, c.max_num_seqs, c.kv_cache_memory, c.kv_cache_dtype) == ("qwen2.5-coder-1.5b", 8, 1 << 30, "int8")
    assert spec.engine_config(small).max_num_seqs == 2  # the server's flag where the model sets nothing
    assert spec.queue_limit(coder) == 16 and spec.queue_limit(small) is None
    for bad, needle in (('[[model]]\nname = "x"', "`model` is required"),
                        ('[[model]]\nmodel = "m"\nspeed = 3', "unknown keys speed"),
                        ('[[model]]\nmodel = "m"\n[model.engine]\nwarp = 9', "no option 'warp'"),
                        ('[[model]]\nmodel = "m"\n[model.engine]\nkv_cache_dtype = "int3"', "must be one of"),
                        ('[[model]]\nmodel = "m"\nwhen = ["queue_full"]', "needs a `fallback`"),
                        ('[[model]]\nmodel = "m"\nfallback = "n"\nwhen = "soon"', "unknown fallback condition"),
                        ('x = 1', "no [[model]] tables"),
                        ('[[model]]\nmodel = "m"\nmax_queue_wait = -1', "max_queue_wait must be"),
                        ('[[model]]\nmodel = "m"\nfallback = "n"', "which is not served"),
                        ('[[model]]\nmodel = "m"\n[[model]]\nmodel = "m"', "is used twice"),
                        ('[[model]]\nmodel = "m"\n[model.engine]\nmax_num_seqs = 0', "model 'm': --max-num-seqs")):
        toml.write_text(bad)
        with pytest.raises(TesseraError, match=re.escape(needle)):
            serving_spec("--config", str(toml))


def _unloaded_within(model: ServedModel, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while model.status != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.02)
    return model.status == "unloaded"


def test_keep_alive_counts_from_the_end_of_the_last_request():
    from tessera.sampling_params import SamplingParams

    model = ServedModel(ModelSpec("a", "m", keep_alive=0.5))
    router = ModelRouter([model], builder=lambda s: fake_engine(step_s=0.05), closer=lambda s: None)
    router.start_reaper(interval_s=0.05)
    try:
        async def long_request() -> None:
            route = await router.route("a")
            params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
            async for _ in route.model.engine.generate("hi", params, "long"):  # ~1.5 s, past keep_alive
                pass

        asyncio.run(long_request())
        time.sleep(0.2)  # several reaper rounds, less than keep_alive since the request ended
        assert model.status == "ready"
        assert _unloaded_within(model, 5)
    finally:
        router.shutdown()


def test_keep_alive_never_unloads_an_engine_while_it_restarts():
    """A dead engine core restarting (loading its model again, seconds) is busy, not idle: the
    reaper waits, and idle time counts from the end of the restart."""
    model = ServedModel(ModelSpec("a", "m", keep_alive=0.3))
    router = ModelRouter([model], builder=lambda s: fake_engine(), closer=lambda s: None)
    try:
        engine = asyncio.run(router.route("a")).model.engine
        engine._restarting = "the engine core exited (code -9)"  # what _restart_core sets meanwhile
        router.start_reaper(interval_s=0.05)
        time.sleep(0.8)  # past keep_alive
        assert model.status == "ready"
        engine._restarting = None
        time.sleep(0.15)
        assert model.status == "ready"  # idle for less than keep_alive since the restart ended
        assert _unloaded_within(model, 5)
    finally:
        router.shutdown()
