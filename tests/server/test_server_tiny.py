"""The server over the real engine (scheduler, KV blocks, sampler) on a tiny random model.

Complements test_server_unit.py (exact formats against a scripted engine) and
test_server_openai.py (a real model in a real `tessera serve` process): here
the real engine runs in seconds, so the KV accounting after cut streams and
the agreement of streamed and whole responses are checked on every test run.
"""
from __future__ import annotations

import asyncio
import time
from typing import Iterator

import httpx
import openai
import pytest
from fakes import serve_in_thread
from tiny_model import make_tiny_model

from tessera.config import EngineConfig
from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.server.app import create_app

NAME = "tiny"


class TinyServer:
    def __init__(self, url: str, engine: AsyncLLMEngine) -> None:
        self.url = url
        self.engine = engine
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/engine/stats").json()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Iterator[TinyServer]:
    from tessera.models.loader import load_model

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")
    loaded = load_model(folder, "float32")
    config = EngineConfig(model=str(folder), dtype="float32", max_model_len=256, max_num_seqs=8,
                          kv_cache_memory=256 * 2 * 2 * 2 * 16 * 4 * 16)  # 256 blocks of 16 tokens
    engine = AsyncLLMEngine(config, engine=LLMEngine(config, loaded=loaded), max_num_queued_requests=24)
    try:
        with serve_in_thread(create_app(engine, [NAME])) as url:
            yield TinyServer(url, engine)
    finally:
        engine.shutdown()


def wait_idle(srv: TinyServer, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = srv.stats()
        s = stats["scheduler"]
        if (s["num_running"], s["num_waiting"], stats["server"]["active_requests"]) == (0, 0, 0) \
                and s["kv_cache_usage"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_stream_matches_whole_response(tiny):
    kw = dict(model=NAME, prompt="the quick brown fox", max_tokens=12, temperature=0, logprobs=2)
    whole = tiny.client.completions.create(**kw)
    chunks = list(tiny.client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == whole.choices[0].logprobs.tokens
    assert whole.usage.completion_tokens == len(whole.choices[0].logprobs.tokens)


def test_chat_template_n_and_seed(tiny):
    kw = dict(model=NAME, messages=[{"role": "user", "content": "hello world"}], max_tokens=8, temperature=1.0,
              seed=3, n=2)
    a = tiny.client.chat.completions.create(**kw)
    b = tiny.client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    streamed = {0: "", 1: ""}
    for chunk in tiny.client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[0], streamed[1]] == [c.message.content for c in a.choices]
    assert a.usage.prompt_tokens > 4  # the template's markers are in the prompt


def test_cut_streams_free_every_block(tiny):
    async def cut(c: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"paged attention {i}", "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    return

    async def main() -> None:
        async with httpx.AsyncClient(base_url=tiny.url, timeout=60) as c:
            await asyncio.gather(*(cut(c, i) for i in range(20)))

    asyncio.run(main())
    stats = wait_idle(tiny)
    assert stats["scheduler"]["num_blocks_free"] == stats["scheduler"]["num_blocks_total"]


def test_too_long_is_400_not_a_crash(tiny):
    r = httpx.post(f"{tiny.url}/v1/completions", json={"prompt": "x", "max_tokens": 10_000})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    assert httpx.get(f"{tiny.url}/health").status_code == 200


@pytest.mark.parametrize("prompt", [[5, -1], [5, 2**40], [5, 10**9]], ids=["negative", "past-u32", "past-vocab"])
def test_echo_of_foreign_token_ids_is_400(tiny, prompt):
    """`echo` decodes a token-id prompt before the engine sees it: ids the model has none for are
    the client's error in OpenAI's shape (a negative one raised the tokenizer's OverflowError: 500)."""
    r = httpx.post(f"{tiny.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "echo": True})
    assert r.status_code == 400, r.text
    assert "prompt token ids" in r.json()["error"]["message"]
    ok = httpx.post(f"{tiny.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "echo": True})
    assert ok.status_code == 200, ok.text


def test_refused_by_forecast_wait_leaks_nothing(tiny):
    """A request whose forecast wait is past --max-queue-wait never reaches the scheduler; on an
    idle engine the forecast is the prompt's own computation, which a deadline shorter than it does
    not refuse but is extended by."""
    from tessera.engine.errors import PredictedWaitError
    from tessera.sampling_params import SamplingParams

    wait_idle(tiny)
    forecast = tiny.engine.predicted_wait(40)
    assert forecast is not None and forecast > 0
    granted: list[float] = []

    async def attempt(rid: str, deadline_s=None) -> None:
        stream = tiny.engine.generate("hello there, general", SamplingParams(max_tokens=4), rid,
                                      deadline_s=deadline_s, extend_deadline=granted.append)
        async for _ in stream:
            pass

    asyncio.run(attempt("forecast-0", deadline_s=forecast / 1000))  # idle: nothing ahead of it
    assert len(granted) == 1 and granted[0] > 0
    before, tiny.engine.max_queue_wait = tiny.engine.max_queue_wait, forecast / 1000
    try:
        with pytest.raises(PredictedWaitError) as info:
            asyncio.run(attempt("forecast-1"))
    finally:
        tiny.engine.max_queue_wait = before
    assert info.value.retry_after > 0
    stats = wait_idle(tiny)
    s = stats["scheduler"]
    assert s["num_blocks_free"] == s["num_blocks_total"]
    assert stats["predicted_queue_wait_s"] >= 0
    model = stats["step_cost_model"]
    assert model["observed_steps"] >= 0 and model["calibration_points"] >= 2
    assert stats["profile"]["name"] == "bursty" and "max_num_seqs" in stats["profile"]["overrides"]


def test_engine_stats_report_the_kv_cache(tiny):
    kv = tiny.stats()["kv_cache"]
    assert kv["tokens"] == kv["num_blocks"] * kv["block_size"] > 0
    assert kv["tokens_per_gib"] == pytest.approx(kv["tokens"] * 2**30 / kv["bytes"], rel=1e-3)
    assert kv["dtype"] in ("float32", "bfloat16", "int8")
