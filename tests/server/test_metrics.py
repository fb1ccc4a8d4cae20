"""Known stats in, exact Prometheus numbers out; plus the consumer thread and the status line."""
from __future__ import annotations

import logging
import random
import re
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tessera.engine.outputs import RequestMetrics
from tessera.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats
from tessera.metrics import PrometheusStatLogger, buckets_1_2_5, buckets_pow2
from tessera.observability import StatsConsumer, build_stat_loggers
from tessera.sampling_params import SamplingParams, StructuredOutputsParams
from tessera.status_log import StatusLineLogger

MODEL = "tiny-test"

COUNTERS = ["prompt_tokens_total", "generation_tokens_total", "request_success_total", "num_preemptions_total",
            "prefix_cache_queries_total", "prefix_cache_hits_total", "admission_rejections_total",
            "request_aborts_total", "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total"]
GAUGES = ["num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc"]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds",
              "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total"]


def finished_request(rng: random.Random, i: int, t0: float) -> FinishedRequestStats:
    """A request with a random life; some aborted while still waiting, some preempted."""
    reason = rng.choice(["stop", "length", "abort", "abort"])
    n_gen = rng.choice([0, rng.randint(1, 40)]) if reason == "abort" else rng.randint(1, 40)
    m = RequestMetrics(arrival_time=t0 + rng.uniform(0, 5))
    if not (reason == "abort" and rng.random() < 0.4):  # else aborted before it was ever scheduled
        m.first_scheduled_time = m.arrival_time + rng.uniform(0, 3)
        if n_gen:
            m.first_token_time = m.first_scheduled_time + rng.uniform(0.001, 2)
            m.last_token_time = m.first_token_time + (n_gen - 1) * rng.uniform(0.002, 0.3)
            m.preempted_times = sorted(rng.uniform(m.first_scheduled_time, m.last_token_time)
                                       for _ in range(rng.choice([0, 0, 1, 2])))
    m.finished_time = (m.last_token_time or m.first_scheduled_time or m.arrival_time) + rng.uniform(0, 0.01)
    return FinishedRequestStats(request_id=f"req-{i}", finish_reason=reason,
                                num_prompt_tokens=rng.randint(1, 3000), num_generation_tokens=n_gen,
                                num_cached_tokens=rng.randint(0, 16), metrics=m, params=SamplingParams())


def make_workload(seed: int = 0, steps: int = 60) -> list[tuple[SchedulerStats, IterationStats]]:
    rng = random.Random(seed)
    t0, out, req = 1_700_000_000.0, [], 0
    for step in range(steps):
        finished = []
        for _ in range(rng.choice([0, 0, 1, 3])):
            finished.append(finished_request(rng, req, t0))
            req += 1
        queries = rng.randint(0, 200)
        it = IterationStats(
            timestamp=t0 + step, num_prompt_tokens=rng.randint(0, 512), num_generation_tokens=rng.randint(0, 32),
            num_preemptions=rng.choice([0, 0, 0, 1, 2]), prefix_cache_queries=queries,
            prefix_cache_hits=rng.randint(0, queries),
            time_to_first_tokens=[rng.uniform(0.0005, 200) for _ in range(rng.randint(0, 3))],
            inter_token_latencies=[rng.uniform(0.0005, 2) for _ in range(rng.randint(0, 8))],
            finished=finished)
        sched = SchedulerStats(num_running=rng.randint(0, 32), num_waiting=rng.randint(0, 9),
                               num_swapped=rng.randint(0, 3), kv_cache_usage=rng.random())
        out.append((sched, it))
    return out


def expected_observations(workload) -> dict[str, list[float]]:
    """What each histogram must have seen, computed from the definitions in docs/operations.md."""
    obs: dict[str, list[float]] = {name: [] for name in HISTOGRAMS}
    for _, it in workload:
        obs["iteration_tokens_total"].append(it.num_prompt_tokens + it.num_generation_tokens)
        obs["time_to_first_token_seconds"] += it.time_to_first_tokens
        obs["inter_token_latency_seconds"] += it.inter_token_latencies
        for f in it.finished:
            m = f.metrics
            obs["request_prompt_tokens"].append(f.num_prompt_tokens)
            obs["request_generation_tokens"].append(f.num_generation_tokens)
            obs["e2e_request_latency_seconds"].append(m.finished_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                obs["request_queue_time_seconds"].append(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                obs["request_prefill_time_seconds"].append(m.first_token_time - m.first_scheduled_time)
                obs["request_decode_time_seconds"].append(m.last_token_time - m.first_token_time)
                if f.num_generation_tokens > 1:
                    obs["request_time_per_output_token_seconds"].append(
                        (m.last_token_time - m.first_token_time) / (f.num_generation_tokens - 1))
    return obs


def scrape(logger: PrometheusStatLogger) -> dict[tuple[str, tuple], float]:
    """Parse render() like Prometheus would: {(sample name, sorted labels): value}."""
    body, content_type = logger.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_every_counter_gauge_and_histogram_matches_what_was_sent():
    workload = make_workload()
    prom = PrometheusStatLogger(MODEL, max_model_len=4096, max_num_batched_tokens=512)
    consumer = StatsConsumer([prom])
    for sched, it in workload:
        consumer.put(sched, it)
    for _ in range(7):
        prom.record_rejection()
    assert consumer.flush(timeout_s=30)
    consumer.stop()
    got = scrape(prom)
    lbl = (("model_name", MODEL),)

    its = [it for _, it in workload]
    finished = [f for it in its for f in it.finished]
    assert len(finished) > 20 and {f.finish_reason for f in finished} == {"stop", "length", "abort"}
    lives = {(f.metrics.first_scheduled_time is None, f.metrics.first_token_time is None) for f in finished}
    assert lives == {(True, True), (False, True), (False, False)}  # never scheduled / no token yet / done
    expected_counters = {
        "prompt_tokens_total": sum(it.num_prompt_tokens for it in its),
        "generation_tokens_total": sum(it.num_generation_tokens for it in its),
        "num_preemptions_total": sum(it.num_preemptions for it in its),
        "prefix_cache_queries_total": sum(it.prefix_cache_queries for it in its),
        "prefix_cache_hits_total": sum(it.prefix_cache_hits for it in its),
        "admission_rejections_total": 7,
        "request_aborts_total": sum(f.finish_reason == "abort" for f in finished),
    }
    for name, value in expected_counters.items():
        assert got[("tessera:" + name, lbl)] == value, name
    for reason in ("stop", "length", "abort"):
        key = ("tessera:request_success_total", (("finished_reason", reason), ("model_name", MODEL)))
        assert got[key] == sum(f.finish_reason == reason for f in finished), reason

    last = workload[-1][0]
    assert got[("tessera:num_requests_running", lbl)] == last.num_running
    assert got[("tessera:num_requests_waiting", lbl)] == last.num_waiting
    assert got[("tessera:num_requests_swapped", lbl)] == last.num_swapped
    assert got[("tessera:kv_cache_usage_perc", lbl)] == pytest.approx(last.kv_cache_usage)

    for name, values in expected_observations(workload).items():
        assert values, f"workload never exercised {name}"
        assert got[(f"tessera:{name}_count", lbl)] == len(values), name
        assert got[(f"tessera:{name}_sum", lbl)] == pytest.approx(sum(values), rel=1e-9), name
        buckets = {float(dict(k)["le"]): v for (n, k), v in got.items() if n == f"tessera:{name}_bucket"}
        assert buckets[float("inf")] == len(values)
        for le, cumulative in buckets.items():
            assert cumulative == sum(v <= le for v in values), (name, le)


def test_names_labels_and_types_are_the_vllm_ones_under_tessera_prefix():
    prom = PrometheusStatLogger(MODEL)
    body = prom.render()[0].decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", body, flags=re.M))
    for name in GAUGES:
        assert types["tessera:" + name] == "gauge"
    for name in COUNTERS:
        assert types["tessera:" + name] == "counter"
        assert f"tessera:{name}{{" in body  # exposed with the _total suffix, zero from the start
    for name in HISTOGRAMS:
        assert types["tessera:" + name] == "histogram"
    assert "_created" not in body
    for line in body.splitlines():
        if not line.startswith("#"):
            assert line.startswith("tessera:") and f'model_name="{MODEL}"' in line, line


def test_each_logger_has_its_own_registry():
    a, b = PrometheusStatLogger("a"), PrometheusStatLogger("b")
    a.record_rejection()
    assert scrape(a)[("tessera:admission_rejections_total", (("model_name", "a"),))] == 1
    assert scrape(b)[("tessera:admission_rejections_total", (("model_name", "b"),))] == 0


def test_an_unknown_finish_reason_is_counted_under_its_own_label():
    prom = PrometheusStatLogger(MODEL)
    f = finished_request(random.Random(1), 0, 1000.0)
    f.finish_reason = "error"
    prom.record(None, IterationStats(timestamp=0.0, finished=[f]))
    got = scrape(prom)
    assert got[("tessera:request_success_total", (("finished_reason", "error"), ("model_name", MODEL)))] == 1
    assert got[("tessera:request_aborts_total", (("model_name", MODEL),))] == 0


def test_structured_output_requests_compile_and_mask_times():
    prom = PrometheusStatLogger(MODEL)
    f = finished_request(random.Random(2), 0, 1000.0)
    f.params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    f.metrics.grammar_compile_time = 0.02
    plain = finished_request(random.Random(3), 1, 1000.0)
    prom.record(None, IterationStats(timestamp=0.0, finished=[f, plain], structured_mask_time=0.0004))
    prom.record(None, IterationStats(timestamp=0.0))  # a step without constrained requests
    got = scrape(prom)
    model = (("model_name", MODEL),)
    assert got[("tessera:structured_output_requests_total", (("kind", "regex"), ("model_name", MODEL)))] == 1
    assert got[("tessera:grammar_compile_seconds_count", model)] == 1
    assert got[("tessera:grammar_compile_seconds_sum", model)] == pytest.approx(0.02)
    assert got[("tessera:structured_output_mask_seconds_count", model)] == 1


def test_bucket_builders():
    assert buckets_1_2_5(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert buckets_1_2_5(1) == [1]
    assert buckets_pow2(512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert buckets_pow2(100) == [1, 2, 4, 8, 16, 32, 64, 100]


# -- the consumer thread ------------------------------------------------------------------------


class Recorder:
    def __init__(self):
        self.records, self.ticks, self.closed = [], 0, []

    def record(self, scheduler_stats, iteration_stats):
        self.records.append((scheduler_stats, iteration_stats))

    def tick(self):
        self.ticks += 1

    def flush(self):
        self.closed.append("flush")

    def shutdown(self):
        self.closed.append("shutdown")


class Broken:
    def record(self, scheduler_stats, iteration_stats):
        raise RuntimeError("exporter down")


def test_consumer_keeps_order_survives_a_broken_logger_and_closes_loggers(caplog):
    good = Recorder()
    consumer = StatsConsumer([Broken(), good], tick_s=0.01)
    items = [(SchedulerStats(num_running=i), IterationStats(timestamp=float(i))) for i in range(50)]
    with caplog.at_level(logging.DEBUG, logger="tessera"):
        for s, it in items:
            consumer.put(s, it)
        assert consumer.flush(timeout_s=10)
        assert good.records == items
        deadline = time.monotonic() + 10
        while good.ticks < 1 and time.monotonic() < deadline:  # ticks come every tick_s
            time.sleep(0.01)
        consumer.stop()
    assert not consumer.alive
    assert good.closed == ["flush", "shutdown"]
    assert good.ticks >= 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "Broken" in errors[0].getMessage()
    assert consumer.flush(timeout_s=0.1) is False  # stopped
    consumer.stop()  # idempotent


def test_build_stat_loggers():
    loggers = build_stat_loggers(MODEL, log_stats=False)
    assert loggers.all() == [loggers.prometheus, loggers.live]
    loggers = build_stat_loggers(MODEL, otlp_traces_endpoint="console")
    assert [type(lg).__name__ for lg in loggers.all()] == ["PrometheusStatLogger", "RequestTracer",
                                                          "StatusLineLogger", "LiveStats"]
    loggers.tracer.shutdown()


# -- the status line ------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_status_line_every_interval_while_busy_and_silent_when_idle(caplog):
    clock = FakeClock()
    status = StatusLineLogger(10.0, clock=clock)
    busy = SchedulerStats(num_running=3, num_waiting=2, num_swapped=1, kv_cache_usage=0.25, num_preemptions=4)
    with caplog.at_level(logging.INFO, logger="tessera"):
        for i in range(4):  # 4 steps over 9 seconds: nothing yet
            clock.now += 2.25 if i else 0.0
            status.record(busy, IterationStats(timestamp=0, num_prompt_tokens=100, num_generation_tokens=25,
                                               num_preemptions=1, prefix_cache_queries=40, prefix_cache_hits=10))
        assert caplog.records == []
        clock.now = 110.0
        status.tick()
        assert len(caplog.records) == 1
        rec = caplog.records[0]
        assert rec.name == "tessera" and rec.levelno == logging.INFO
        line = rec.getMessage()
        assert "prompt throughput: 40.0 tokens/s" in line  # 400 tokens / 10 s
        assert "generation throughput: 10.0 tokens/s" in line
        assert "running: 3, waiting: 2, swapped: 1" in line
        assert "KV cache usage: 25.0%" in line
        assert "prefix cache hit rate: 25.0%" in line
        assert "preemptions: 4 (total 4)" in line

        # the burst ends: the last step reports nothing left; that interval is still reported once
        clock.now = 112.0
        status.record(SchedulerStats(), IterationStats(timestamp=0, num_generation_tokens=20))
        clock.now = 120.0
        status.tick()
        assert len(caplog.records) == 2 and "generation throughput: 2.0 tokens/s" in caplog.records[1].getMessage()
        for _ in range(5):  # then idle: silent
            clock.now += 10.0
            status.tick()
        assert len(caplog.records) == 2


# -- against a real server ------------------------------------------------------------------------


@pytest.mark.model
def test_real_server_metrics_count_exactly_the_requests_sent():
    """Known requests to `tessera serve`'s app; /metrics must count them, and agree with the traces."""
    import json
    import socket
    import threading
    import time

    import httpx
    import uvicorn
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tessera.config import EngineConfig
    from tessera.engine.frontend.async_engine import AsyncLLMEngine
    from tessera.observability import StatLoggers
    from tessera.server.app import create_app
    from tessera.tracing import RequestTracer

    name = "smollm2-135m"
    spans = InMemorySpanExporter()
    loggers = StatLoggers(prometheus=PrometheusStatLogger(name), tracer=RequestTracer(name, spans))
    consumer = StatsConsumer(loggers.all())
    # one sequence at a time and one waiting slot, so that a third request is refused for sure
    engine = AsyncLLMEngine(EngineConfig(model=name, max_num_seqs=1), max_num_queued_requests=1, stats_sink=consumer)
    app = create_app(engine, [name], metrics=loggers.prometheus)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    server_thread = threading.Thread(target=server.run, daemon=True)
    server_thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)

        def engine_stats() -> dict:
            return client.get("/v1/engine/stats").json()["scheduler"]

        def wait_for(cond, what: str) -> None:
            end = time.monotonic() + 60
            while not cond():
                assert time.monotonic() < end, f"timed out waiting for {what}"
                time.sleep(0.02)

        finished: dict[str, dict] = {}  # response id -> {"reason", "prompt", "completion"}
        for i, prompt in enumerate(["The sky is", "One, two, three,", "def add(a, b):"]):
            r = client.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 3 + i,
                                                     "temperature": 0, "ignore_eos": True}).json()
            assert r["choices"][0]["finish_reason"] == "length"
            finished[r["id"]] = {"reason": "length", **r["usage"]}
        r = client.post("/v1/chat/completions", json={"model": name, "max_tokens": 24, "temperature": 0,
                                                      "messages": [{"role": "user", "content": "Say hi."}]}).json()
        finished[r["id"]] = {"reason": r["choices"][0]["finish_reason"], **r["usage"]}

        # A streams and then hangs up (an abort); while it runs B waits and C, D are refused with 429
        statuses = []
        with client.stream("POST", "/v1/completions",
                           json={"model": name, "prompt": "Once upon a time", "max_tokens": 1000,
                                 "ignore_eos": True, "stream": True}) as stream_a:
            lines = stream_a.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            aborted_id = json.loads(first[len("data: "):])["id"]
            wait_for(lambda: engine_stats()["num_running"] == 1, "A running")
            b_result: dict = {}
            b = threading.Thread(target=lambda: b_result.update(client.post("/v1/completions", json={
                "model": name, "prompt": "Paris is", "max_tokens": 2, "ignore_eos": True}).json()))
            b.start()
            wait_for(lambda: engine_stats()["num_waiting"] == 1, "B waiting")
            for _ in range(2):
                statuses.append(client.post("/v1/completions", json={"model": name, "prompt": "x",
                                                                     "max_tokens": 1}).status_code)
        b.join(120)
        assert statuses == [429, 429]
        finished[b_result["id"]] = {"reason": "length", **b_result["usage"]}

        wait_for(lambda: (lambda s: s["num_running"] == 0 and s["num_waiting"] == 0)(engine_stats()), "idle")
        assert consumer.flush(timeout_s=30) and loggers.tracer.flush()
        body = client.get("/metrics")
        assert body.status_code == 200 and body.headers["content-type"].startswith("text/plain")
        got = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(body.text) for s in fam.samples}
    finally:
        server.should_exit = True
        server_thread.join(30)
        engine.shutdown()
        consumer.stop()

    lbl = (("model_name", name),)
    by_id = {s.attributes["gen_ai.response.id"]: s for s in spans.get_finished_spans()}
    assert set(by_id) == set(finished) | {aborted_id}  # one span per request that reached the engine
    a = by_id[aborted_id]
    assert a.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    a_prompt, a_generated = a.attributes["gen_ai.usage.input_tokens"], a.attributes["gen_ai.usage.output_tokens"]
    assert 1 <= a_generated < 1000
    for rid, f in finished.items():
        assert by_id[rid].attributes["gen_ai.usage.output_tokens"] == f["completion_tokens"]
        assert by_id[rid].attributes["gen_ai.usage.input_tokens"] == f["prompt_tokens"]

    reasons = [f["reason"] for f in finished.values()] + ["abort"]
    for reason in ("stop", "length", "abort"):
        assert got[("tessera:request_success_total", (("finished_reason", reason),) + lbl)] == reasons.count(reason)
    assert got[("tessera:request_aborts_total", lbl)] == 1
    assert got[("tessera:admission_rejections_total", lbl)] == 2

    generated = [f["completion_tokens"] for f in finished.values()] + [a_generated]
    prompts = [f["prompt_tokens"] for f in finished.values()] + [a_prompt]
    cached = sum(s.attributes["gen_ai.usage.cache_read.input_tokens"] for s in by_id.values())
    assert got[("tessera:generation_tokens_total", lbl)] == sum(generated)
    assert got[("tessera:prompt_tokens_total", lbl)] == sum(prompts) - cached  # no preemption with one sequence
    assert got[("tessera:num_preemptions_total", lbl)] == 0
    assert got[("tessera:iteration_tokens_total_sum", lbl)] == sum(generated) + sum(prompts) - cached
    assert got[("tessera:request_generation_tokens_sum", lbl)] == sum(generated)
    assert got[("tessera:request_prompt_tokens_sum", lbl)] == sum(prompts)
    n = len(reasons)
    for hist in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert got[(f"tessera:{hist}_count", lbl)] == n, hist
    assert got[("tessera:time_to_first_token_seconds_count", lbl)] == n
    assert got[("tessera:inter_token_latency_seconds_count", lbl)] == sum(g - 1 for g in generated)
    assert got[("tessera:request_time_per_output_token_seconds_count", lbl)] == sum(g > 1 for g in generated)
    assert got[("tessera:num_requests_running", lbl)] == 0
    assert got[("tessera:num_requests_waiting", lbl)] == 0
    assert got[("tessera:kv_cache_usage_perc", lbl)] == 0


def test_speculative_counts_by_position():
    prom = PrometheusStatLogger(MODEL)
    prom.record(None, IterationStats(timestamp=0.0, spec_results=[(4, 2), (3, 0), (4, 4)]))
    got = scrape(prom)
    lbl = (("model_name", MODEL),)
    assert got[("tessera:spec_decode_num_drafts_total", lbl)] == 3
    assert got[("tessera:spec_decode_num_draft_tokens_total", lbl)] == 11
    assert got[("tessera:spec_decode_num_accepted_tokens_total", lbl)] == 6
    per_pos = {dict(k[1])["position"]: v for k, v in got.items()
               if k[0] == "tessera:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 2, "1": 2, "2": 1, "3": 1}


def test_gpu_memory_gauges_only_for_a_gpu_engine():
    from tessera.engine.stats import SchedulerStats

    prom = PrometheusStatLogger(MODEL)
    prom.record(SchedulerStats(num_running=1), None)  # a CPU engine: no GPU series at all
    assert not [k for k in scrape(prom) if "gpu_memory" in k[0]]
    prom.record(SchedulerStats(gpu_memory_allocated_bytes=3 << 30, gpu_memory_total_bytes=141 << 30), None)
    got, lbl = scrape(prom), (("model_name", MODEL),)
    assert got[("tessera:gpu_memory_allocated_bytes", lbl)] == 3 << 30
    assert got[("tessera:gpu_memory_total_bytes", lbl)] == 141 << 30
