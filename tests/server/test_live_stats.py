"""The dashboard's rolling stats (tessera.live_stats) and its endpoint, /v1/engine/live."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from fakes import MODEL, FakeCore, serve_in_thread

from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.engine.stats import IterationStats, SchedulerStats
from tessera.live_stats import LiveStats, percentile
from tessera.server.app import create_app


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0


def test_series_rates_percentiles_and_carried_state():
    clock = Clock()
    live = LiveStats("m", history_s=60, window_s=2, clock=clock)
    live.record(SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.25),
                IterationStats(timestamp=0, num_prompt_tokens=100, num_generation_tokens=2,
                               time_to_first_tokens=[0.1, 0.3], prefix_cache_queries=100, prefix_cache_hits=40))
    clock.t += 1
    live.record(None, IterationStats(timestamp=0, num_generation_tokens=4, inter_token_latencies=[0.05, 0.07]))
    live.record_rejection()
    clock.t += 2  # an idle second (no step) and then now
    snap = live.snapshot(seconds=4)
    s = snap["series"]
    assert s["t"] == [1000, 1001, 1002, 1003]
    # t=1000: first second of history; t=1001: window [1000, 1001]; t=1003: window [1002, 1003], empty.
    i0 = s["t"].index(1000)
    assert s["prompt_tps"][i0] == 100 and s["generation_tps"][i0] == 2
    assert s["generation_tps"][i0 + 1] == 3.0  # (2 + 4) tokens over the 2 s window
    assert s["generation_tps"][-1] == 0
    assert s["ttft_p50_ms"][i0] == 200.0 and s["ttft_p95_ms"][i0] == pytest.approx(290.0)
    assert s["itl_p50_ms"][i0 + 1] == 60.0
    assert s["running"][i0:] == [2, 2, 2, 2]  # the state carries through seconds without a report
    assert s["kv_usage"][i0] == 0.25 and s["prefix_hit_rate"][i0] == 0.4
    assert s["rejections"][i0 + 1] == 1
    assert s["ttft_p50_ms"][-1] is None  # nothing in the window
    summary = snap["summary"]
    assert summary["rejections"] == 1 and summary["ttft_ms"]["p50"] == 200.0
    assert snap["totals"]["generation_tokens"] == 6 and snap["current"]["running"] == 2


def test_history_is_bounded():
    clock = Clock()
    live = LiveStats("m", history_s=30, clock=clock)
    for _ in range(500):
        live.record(None, IterationStats(timestamp=0, num_generation_tokens=1))
        clock.t += 1
    assert len(live._seconds) <= 30
    snap = live.snapshot()
    assert len(snap["series"]["t"]) == 30 and snap["totals"]["generation_tokens"] == 500
    with pytest.raises(ValueError):
        LiveStats("m", history_s=0)


def test_live_endpoint_counts_tokens_and_429s():
    core = FakeCore(step_s=0.02, max_num_seqs=1)
    live = LiveStats(MODEL)
    engine = AsyncLLMEngine(core.config, engine=core, max_num_queued_requests=2, stat_loggers=[live])
    app = create_app(engine, [MODEL], live=live)
    try:
        with serve_in_thread(app) as url:
            async def flood() -> list[int]:
                async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                    reqs = [client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5}) for _ in range(12)]
                    return [r.status_code for r in await asyncio.gather(*reqs)]

            statuses = asyncio.run(flood())
            assert 429 in statuses and 200 in statuses
            body = httpx.get(f"{url}/v1/engine/live", params={"seconds": 20}).json()
            model = body["models"][0]
            assert model["model"] == MODEL and len(model["series"]["t"]) == 20
            assert model["summary"]["rejections"] == statuses.count(429)
            assert model["totals"]["generation_tokens"] >= 5 * statuses.count(200)
            assert model["current"]["running"] == 0
            assert model["settings"]["max_num_seqs"] == core.config.max_num_seqs
            assert httpx.get(f"{url}/v1/engine/live", params={"seconds": "x"}).status_code == 400
            assert httpx.get(url + "/").status_code == 200
    finally:
        engine.shutdown()


def test_no_ui_and_no_live_stats():
    core = FakeCore()
    engine = AsyncLLMEngine(core.config, engine=core)
    app = create_app(engine, [MODEL], ui=False)
    try:
        with serve_in_thread(app) as url:
            root = httpx.get(url + "/")  # no chat page: Ollama's liveness answer, as Ollama gives it
            assert root.status_code == 200 and root.text == "Ollama is running"
            assert httpx.get(url + "/dashboard").status_code == 404
            assert httpx.get(url + "/static/chat.js").status_code == 404
            r = httpx.get(url + "/v1/engine/live")
            assert r.status_code == 404 and r.json()["error"]["code"] == "live_stats_disabled"
    finally:
        engine.shutdown()
