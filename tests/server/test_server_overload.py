"""The HTTP server under load and failure, against a scripted engine core: the queue bound and the
wait forecast (429s), request timeouts, client disconnects aborting their requests, a dead
engine (503), the core protocol, draining on shutdown, and keepalives before a slow first token."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import uvicorn
from fakes import MODEL, REPLY, FakeCore, live_server, serve_in_thread
from http_checks import assert_error, post, sse_events

from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.sampling_params import SamplingParams
from tessera.server.app import create_app
from tessera.server.launch import DrainingServer


def test_queue_full_is_429_then_recovers():
    core = FakeCore(step_s=0.02, max_num_seqs=1)
    with live_server(core, max_num_queued_requests=2) as s:
        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as client:
                reqs = [client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": i % 2 == 0})
                        for i in range(12)]
                return await asyncio.gather(*reqs)

        responses = asyncio.run(flood())
        statuses = [r.status_code for r in responses]
        assert statuses.count(429) >= 5 and statuses.count(200) >= 2, statuses
        for r in responses:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                err = assert_error(r, 429, "queue full")
                assert err["code"] == "queue_full"
        assert s.metrics.rejections == statuses.count(429)
        s.wait_idle()
        ok = [post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code for _ in range(3)]
        assert ok == [200, 200, 200]


def test_forecast_wait_past_the_deadline_is_429_at_once():
    core = FakeCore(step_s=0.02, forecast_wait_s=32.4)
    with live_server(core, request_timeout=10) as s:
        for stream in (False, True):
            t0 = time.monotonic()
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": stream},
                           timeout=30)
            assert time.monotonic() - t0 < 2  # refused now, not after the 10 s timeout
            err = assert_error(r, 429, "forecast wait")
            assert err["code"] == "queue_wait_exceeds_deadline"
            assert r.headers["retry-after"] == "23"  # 32.4 s forecast - 10 s deadline, rounded up
        assert s.metrics.rejections == 2
        assert not core.waiting and not core.running and core.free_blocks == core.num_blocks
        core.forecast_wait_s = 3.0  # under the deadline: served
        assert post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_prompts_own_computation_is_added_to_its_deadline():
    """The forecast's part that is the prompt's own computation moves the deadline rather than
    refusing the request (a long prompt is served, not cut for being long); only the wait for the
    work ahead of it is held against the deadline."""
    body = {"prompt": "x", "max_tokens": 20, "ignore_eos": True}
    core = FakeCore(step_s=0.05, forecast_wait_s=0.3, own_prompt_s=0.0)
    with live_server(core, request_timeout=0.4) as s:
        assert_error(post(s, "/v1/completions", body), 504, "timeout")  # ~1 s of work, 0.4 s deadline
        s.wait_idle()
        core.forecast_wait_s, core.own_prompt_s = 1.3, 1.0  # 0.3 s ahead of it, 1 s its own
        r = post(s, "/v1/completions", body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20, r.text
        core.forecast_wait_s = 2.0  # 1 s ahead of it: past the deadline whatever its own part
        r = post(s, "/v1/completions", body)
        assert assert_error(r, 429, "work ahead")["code"] == "queue_wait_exceeds_deadline"
        assert r.headers["retry-after"] == "1"
        assert not core.waiting and not core.running and core.free_blocks == core.num_blocks


def test_max_queue_wait_refuses_what_would_wait_longer():
    core = FakeCore(step_s=0.02, forecast_wait_s=4.2)
    with live_server(core, max_queue_wait=1.5) as s:  # no request deadline: the server's own bound
        r = post(s, "/v1/completions", {"prompt": "x", "max_tokens": 5})
        err = assert_error(r, 429, "max-queue-wait")
        assert err["code"] == "queue_wait_exceeds_deadline" and r.headers["retry-after"] == "3"
        core.forecast_wait_s = 1.0
        assert post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_request_timeout_non_stream_and_stream():
    core = FakeCore(step_s=0.05)
    with live_server(core, request_timeout=0.4) as s:
        started = time.monotonic()
        r = post(s, "/v1/completions", {"prompt": "x", "max_tokens": 200, "ignore_eos": True})
        assert time.monotonic() - started < 2
        err = assert_error(r, 504, "timeout")
        assert (err["type"], err["code"]) == ("timeout_error", "request_timeout")
        s.wait_idle()

        r = post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 200,
                                             "ignore_eos": True, "stream": True})
        assert r.status_code == 200
        events = sse_events(r)
        assert events[-1] != "[DONE]" and events[-1]["error"]["code"] == "request_timeout"
        assert any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events[:-1])
        s.wait_idle()
        assert post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_twenty_streams_cut_midway_free_everything():
    core = FakeCore(step_s=0.01, max_num_seqs=8, num_blocks=400)

    async def cut(client: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"stream {i}", "max_tokens": 150, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            received = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    received += 1
                    if received == 3:
                        break  # leaving the block closes the connection mid-stream
        return received

    with live_server(core) as s:
        async def main() -> list[int]:
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as client:
                results = await asyncio.gather(*(cut(client, i) for i in range(20)))
                # While the cut streams are aborted, a request on another connection is still served whole.
                r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "temperature": 0})
                assert r.json()["choices"][0]["text"] == REPLY[:3]
                return results

        started = time.monotonic()
        assert asyncio.run(main()) == [3] * 20
        stats = s.wait_idle(timeout=5)
        assert stats["scheduler"]["kv_cache_usage"] == 0
        assert len(core.aborted) == 20
        assert time.monotonic() - started < 10  # 20 x 150 tokens would take much longer unaborted


def test_non_streaming_client_disconnect_aborts():
    core = FakeCore(step_s=0.02)
    with live_server(core) as s:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True},
                       timeout=0.3)
        s.wait_idle(timeout=2)  # 200 steps of 20 ms would take 4 s
        assert len(core.aborted) == 1


def test_dead_engine_gives_503():
    core = FakeCore(fail_after_steps=3)
    with live_server(core) as s:
        r = post(s, "/v1/completions", {"prompt": "x", "max_tokens": 20, "temperature": 0, "stream": True})
        events = sse_events(r)  # two tokens, then the crash
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == REPLY[:2]
        assert events[-1]["error"]["code"] == "engine_dead"
        r = post(s, "/v1/completions", {"prompt": "x", "max_tokens": 20})
        err = assert_error(r, 503)
        assert err["code"] == "engine_dead"
        health = httpx.get(f"{s.url}/health")
        assert_error(health, 503, "engine")
        assert_error(post(s, "/v1/completions", {"prompt": "x"}), 503)
        assert httpx.get(f"{s.url}/v1/models").status_code == 200  # the HTTP side is still up


class DyingCore(FakeCore):
    """A core that dies on its own (as a process core's process can) and is restarted in place."""

    def __init__(self) -> None:
        super().__init__()
        self.dead = False
        self.restarts = 0

    @property
    def alive(self) -> bool:
        return not self.dead

    def restart(self) -> None:
        self.dead, self.restarts = False, self.restarts + 1

    def describe(self) -> dict:
        return {"engine_process": True, "pid": 4242, "restarts": self.restarts}


def test_the_front_end_asks_the_core_protocol_not_its_kind():
    """A core of a kind AsyncLLMEngine has never heard of: it reports where it runs through
    `describe()`, and dying while idle (`alive` False) gets it `restart()`ed, then it serves."""
    core = DyingCore()
    engine = AsyncLLMEngine(core.config, engine=core)
    try:
        assert engine.core_info() == {"engine_process": True, "pid": 4242, "restarts": 0}
        core.dead = True
        deadline = time.monotonic() + 5
        while core.restarts == 0:
            assert time.monotonic() < deadline, "the idle core's death was not noticed"
            time.sleep(0.01)
        assert engine.core_info()["restarts"] == 1

        async def one() -> str:
            text = ""
            async for out in engine.generate("hi", SamplingParams(max_tokens=5, temperature=0), "after"):
                text = out.outputs[0].text
            return text

        assert asyncio.run(one()) == REPLY[:5]
        engine.check_health()
    finally:
        engine.shutdown()


def test_shutdown_drains_then_ends_running_requests_cleanly():
    """SIGTERM: new requests get 503 at once, a short request still finishes, and what runs past
    --shutdown-timeout ends with a final error event / 503 rather than a cut connection."""
    core = FakeCore(step_s=0.02)
    engine = AsyncLLMEngine(core.config, engine=core)
    app = create_app(engine, [MODEL])
    server = DrainingServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5),
                            app.state.tessera, shutdown_timeout=0.6)
    results: dict[str, object] = {}

    def stream(url: str) -> None:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True,
                                                      "stream": True}, timeout=10)
        results["stream"] = sse_events(r)

    def whole(url: str) -> None:
        results["whole"] = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 200,
                                                                     "ignore_eos": True}, timeout=10)

    def short(url: str) -> None:
        results["short"] = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 5,
                                                                     "ignore_eos": True}, timeout=10)

    try:
        with serve_in_thread(app, server) as url:
            clients = [threading.Thread(target=f, args=(url,)) for f in (stream, whole, short)]
            for t in clients:
                t.start()
            deadline = time.monotonic() + 10
            while len(core.running) + len(core.waiting) + ("short" in results) < 3:  # all admitted first
                assert time.monotonic() < deadline
                time.sleep(0.005)
            started = time.monotonic()
            server.drain()
            assert_error(httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10), 503, "shutting down")
            assert_error(httpx.get(f"{url}/health"), 503, "shutting down")
            for t in clients:
                t.join(10)
            assert time.monotonic() - started < 3
        assert results["short"].status_code == 200  # finished within the drain
        events = results["stream"]
        assert events[-1]["error"]["code"] == "server_shutting_down" and len(events) > 2
        assert_error(results["whole"], 503, "shutting down")
        deadline = time.monotonic() + 2
        while core.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)  # the engine thread takes the aborts at its next step
        assert len(core.aborted) == 2 and core.free_blocks == core.num_blocks
    finally:
        engine.shutdown()


def test_a_slow_first_token_starts_the_stream_with_keepalives(monkeypatch):
    """A prompt whose first token takes longer than STREAM_START_S: the stream starts (role chunk)
    and keep-alive comments come until the token does; refusals still come as a status."""
    from tessera.server import serving

    monkeypatch.setattr(serving, "STREAM_START_S", 0.2)
    monkeypatch.setattr(serving, "KEEPALIVE_S", 0.1)
    core = FakeCore(step_s=0.6)
    with live_server(core) as s:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True, "temperature": 0}
        r = post(s, "/v1/chat/completions", body)
        assert r.status_code == 200
        blocks = r.text.split("\n\n")
        assert blocks[0].startswith("data: ") and json.loads(blocks[0][6:])["choices"][0]["delta"]["role"]
        assert blocks[1] == ": keep-alive"  # before the first token's chunk
        content = [json.loads(b[6:]) for b in blocks if b.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in content if c["choices"]) == REPLY[:2]
        assert blocks[-2] == "data: [DONE]"
        assert_error(post(s, "/v1/completions", {"prompt": "x", "max_tokens": 10**6, "stream": True}), 400,
                     "context length")
        s.wait_idle()
