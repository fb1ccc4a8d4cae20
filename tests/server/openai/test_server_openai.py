"""`tessera serve` as a real process, driven by the official openai client and raw HTTP.

Needs the packaged smollm2-135m model (pulled on first use), hence @pytest.mark.model.
One server process serves every test of the module; it bounds its queue low
enough (--max-num-queued-requests 24, --max-num-seqs 8) that a flood sees 429s,
while 20 concurrent streams still fit (arrivals not yet scheduled count as waiting).
"""
from __future__ import annotations

import asyncio
import re
import signal
import time
from typing import Iterator

import httpx
import openai
import pytest
from server_process import ServerProcess, running_server

pytestmark = pytest.mark.model

MODEL = "smollm2-135m"
MAX_QUEUED = 24
MAX_SEQS = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("serve") / "server.log",
                        "--max-num-queued-requests", str(MAX_QUEUED), "--max-num-seqs", str(MAX_SEQS)) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, flags=re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


# ----------------------------------------------------------------------------- the openai client


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completion(client):
    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert c.id.startswith("cmpl-") and c.object == "text_completion" and c.model == MODEL
    assert len(c.choices) == 1 and c.choices[0].text.strip()
    assert c.choices[0].finish_reason in ("stop", "length")
    assert c.usage.prompt_tokens > 0 and 0 < c.usage.completion_tokens <= 8
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    again = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert again.choices[0].text == c.choices[0].text  # greedy is deterministic


def test_completion_batch_n_and_seed(client):
    kwargs = dict(model=MODEL, prompt=["Once upon a time", "def fibonacci(n):"], max_tokens=10, temperature=1.0,
                  n=2, seed=1234)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert 4 <= a.usage.completion_tokens <= 40
    assert len({c.text for c in a.choices}) > 1
    other = client.completions.create(**{**kwargs, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]


def test_completion_stop_and_logprobs(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text.strip()[:2] if len(text.strip()) >= 2 else text
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert text.startswith(cut.choices[0].text)

    lp = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=5, temperature=0, logprobs=3)
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(v <= 0 for v in logprobs.token_logprobs)
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs):
        assert token in top and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(top[token], abs=1e-4)  # greedy picks the best
    assert "".join(logprobs.tokens) == lp.choices[0].text


def test_completion_stream(client):
    stream = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    whole = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=12, temperature=0)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")


def test_chat(client):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": [{"type": "text", "text": "What is 2+2? Answer briefly."}]}]
    # Warm the prefix cache so both compared requests take the same path: a fresh prompt runs
    # prefill-sized matmuls on dense weights, a cached one only its last few tokens through the
    # int4 kernel, and in bfloat16 the two round differently enough to move a greedy tie.
    client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=1, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content.strip()
    assert "<|im_start|>" not in r.choices[0].message.content
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens <= 20

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [r.choices[0].finish_reason]
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_chat_stream_n_seed_and_logprobs(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=8,
                  temperature=1.0, seed=7, n=3, logprobs=True, top_logprobs=2)
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    # Warm the prefix cache first, so both compared requests take the same computation path:
    # in bfloat16 a cached prompt block and a freshly computed one round differently, which
    # can move a temperature-1 sample (the sampler's randomness itself is seeded per choice).
    client.chat.completions.create(**kwargs)
    for ch in client.chat.completions.create(stream=True, **kwargs):
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.content:
                assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    whole = client.chat.completions.create(**kwargs)
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert all(c.logprobs.content and len(c.logprobs.content) <= 8 for c in whole.choices)


# ----------------------------------------------------------------------------- errors over raw HTTP


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/completions", b"{oops", 400, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -0.5}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": ""}', 400, "empty"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000000}', 400, "context length"),
    ("/v1/completions", b'{"prompt": [1, 2, 999999999]}', 400, "token id"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}', 404,
     "The model `gpt-4o` does not exist."),
])
def test_error_classes(server, path, body, status, needle):
    r = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and needle in err["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


# ----------------------------------------------------------------------------- backpressure and cancellation


def test_flood_sees_429_then_recovers(server):
    async def flood() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as c:
            # Long enough that no admitted request finishes while the flood is still arriving (with 24
            # tokens, a server whose prompts attend in C drained enough of it to pass only 14 429s).
            body = {"model": MODEL, "prompt": "Count from one to twenty:", "max_tokens": 128, "ignore_eos": True}
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(60)))

    responses = asyncio.run(flood())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 20 and statuses.count(200) >= MAX_SEQS, statuses
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"].isdigit()
            assert r.json()["error"]["code"] == "queue_full"
    server.wait_idle()
    metrics = httpx.get(f"{server.url}/metrics").text
    assert metric(metrics, "tessera:admission_rejections_total") >= statuses.count(429)
    # Full recovery: every request of a modest burst is served.
    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
            return [r.status_code for r in await asyncio.gather(*(c.post("/v1/completions", json=body)
                                                                  for _ in range(MAX_SEQS)))]
    assert asyncio.run(burst()) == [200] * MAX_SEQS


def test_twenty_streams_cut_midway_leave_nothing_behind(server):
    async def cut(c: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "prompt": f"Write a long essay about the number {i}.", "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            received = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    received += 1
                    if received == 5:
                        break  # leaving the block closes the connection mid-stream
            return received

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=40)) as c:
            return await asyncio.gather(*(cut(c, i) for i in range(20)))

    before = metric(httpx.get(f"{server.url}/metrics").text, "tessera:request_aborts_total")
    assert asyncio.run(main()) == [5] * 20
    stats = server.wait_idle()
    assert stats["scheduler"]["num_blocks_free"] == stats["scheduler"]["num_blocks_total"]
    deadline = time.monotonic() + 10
    while True:  # the Prometheus gauges follow on the stats thread
        metrics = httpx.get(f"{server.url}/metrics").text
        done = (metric(metrics, "tessera:num_requests_running") == 0
                and metric(metrics, "tessera:kv_cache_usage_perc") == 0
                and metric(metrics, "tessera:request_aborts_total") - before >= 20)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert done, metrics


def test_non_streaming_disconnect_aborts(server):
    body = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    server.wait_idle(timeout=10)


def test_request_timeout(tmp_path):
    proc = ServerProcess(tmp_path / "server.log", "--request-timeout", "3")  # admitted well within it
    try:
        proc.wait_healthy()
        body = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 2000, "ignore_eos": True}
        r = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        with httpx.stream("POST", f"{proc.url}/v1/chat/completions", timeout=60,
                          json={**{k: v for k, v in body.items() if k != "prompt"}, "stream": True,
                                "messages": [{"role": "user", "content": "Tell me everything."}]}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert '"request_timeout"' in lines[-1] and "[DONE]" not in lines[-1]
        proc.wait_idle()
        assert re.search(r'"POST /v1/completions" 504 .*timed out', proc.log())
    finally:
        proc.stop()


def test_sigterm_drains_then_exits_zero(tmp_path):
    """SIGTERM: new requests get 503 while a running stream may finish; past --shutdown-timeout
    it ends with a final error event, and the process exits 0."""
    proc = ServerProcess(tmp_path / "server.log", "--shutdown-timeout", "2")
    try:
        proc.wait_healthy()
        body = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 2000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{proc.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            refused = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
            assert httpx.get(f"{proc.url}/health", timeout=10).status_code == 503
            rest = [line for line in lines if line.startswith("data: ")]
        assert first and '"server_shutting_down"' in rest[-1]
        assert proc.proc.wait(30) == 0
    finally:
        proc.stop()
