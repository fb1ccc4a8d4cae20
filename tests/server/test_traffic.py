"""Traffic traces: recording (`--record-traffic`), the format's checks, replay, and the live SLO.

The end-to-end test records a trace from a real server (the tiny model's engine), replays it at
1x against the same server while recording a second trace, and compares the two: arrivals,
token lengths (two-sample KS tests) and the prefix sharing the hashes show.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from scipy.stats import ks_2samp
from fakes import serve_in_thread
from tiny_model import make_tiny_model

from tessera.bench import replay
from tessera.bench.datasets import random_workload, shared_prefix_workload
from tessera.bench.runner import Target, run_open_loop
from tessera.engine.core.block_pool import hash_block
from tessera.errors import ConfigError
from tessera.server import traffic
from tessera.server.traffic import (RecordSettings, TraceError, TrafficRecorder, prefix_hashes, prefix_hit_rate,
                                    read_trace)
from tessera.slo import SLOSpec

GOOD = {"t": 100.0, "endpoint": "completions", "model": "m", "prompt_tokens": 40, "output_tokens": 8,
        "prefix_hashes": ["00000000000000aa", "00000000000000bb"], "block_size": 16, "stream": True, "status": 200}


def write_trace(path: Path, *lines, head=None) -> Path:
    head = traffic.header(False) if head is None else head
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in (head, *lines)) + "\n")
    return path


# ----------------------------------------------------------------------------- format

def test_prefix_hashes_are_the_prefix_cache_chain():
    ids = list(range(40))
    hashes = prefix_hashes(ids, 16)
    assert len(hashes) == 2  # the partial third block is not hashed
    first = hash_block(None, ids[:16])
    assert hashes == [f"{first:016x}", f"{hash_block(first, ids[16:32]):016x}"]
    assert prefix_hashes(ids[:16] + [999] * 16, 16)[0] == hashes[0] != prefix_hashes([999] * 32, 16)[0]


def test_reads_a_valid_trace_sorted_by_arrival(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", {**GOOD, "t": 105.0}, GOOD, "")
    trace = read_trace(path)
    assert [r.t for r in trace.records] == [100.0, 105.0] and trace.duration == 5.0


@pytest.mark.parametrize("lines, head, message", [
    ([], None, "no requests"),
    ([GOOD], {"format": "something-else"}, "not a Tessera traffic trace"),
    ([GOOD], {"format": "tessera-traffic", "version": 2}, "version 2 is newer than this Tessera reads"),
    ([GOOD], {"format": "tessera-traffic"}, "no valid format version"),
    (["{not json"], None, "line 2: not JSON"),
    ([[1, 2]], None, "line 2: a record must be a JSON object"),
    ([{k: v for k, v in GOOD.items() if k not in ("prompt_tokens", "t")}], None,
     "line 2: missing field(s) t, prompt_tokens"),
    ([{**GOOD, "prompt_tokens": "40"}], None, "field 'prompt_tokens' must be int"),
    ([{**GOOD, "stream": 1}], None, "field 'stream' must be bool"),
    ([{**GOOD, "output_tokens": True}], None, "field 'output_tokens' must be int"),
    ([{**GOOD, "endpoint": "embeddings"}], None, "endpoint must be one of"),
    ([{**GOOD, "prompt_tokens": 10}], None, "2 prefix hashes for 10 prompt tokens"),
    ([GOOD, {**GOOD, "block_size": 0}], None, "line 3: field 'block_size' must not be below 1"),
])
def test_refuses_bad_traces_with_a_clear_message(tmp_path, lines, head, message):
    path = write_trace(tmp_path / "t.jsonl", *lines, head=head)
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_trace(path)


def test_refuses_empty_binary_and_missing_files(tmp_path):
    (tmp_path / "empty").write_text("")
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00garbage")
    for name, message in (("empty", "empty file"), ("bin", "not UTF-8"), ("missing", "cannot read trace")):
        with pytest.raises(TraceError, match=message):
            read_trace(tmp_path / name)


def test_skip_invalid_leaves_bad_lines_out_and_says_so(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", GOOD, "garbage", {**GOOD, "t": 101.0, "status": "ok"})
    trace = read_trace(path, skip_invalid=True)
    assert len(trace.records) == 1 and len(trace.skipped) == 2 and "line 3: not JSON" in trace.skipped[0]


def test_azure_csv_import(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n")
    trace = replay.load_trace([path])
    assert [(r.prompt_tokens, r.output_tokens) for r in trace.records] == [(374, 44), (396, 109)]
    assert trace.duration == pytest.approx(4.314579, abs=1e-5)
    (tmp_path / "bad.csv").write_text("time,tokens\n1,2\n")
    with pytest.raises(TraceError, match="no column.*TIMESTAMP, ContextTokens, GeneratedTokens"):
        replay.load_trace([tmp_path / "bad.csv"])
    (tmp_path / "bad2.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,4\n")
    with pytest.raises(TraceError, match="line 2: TIMESTAMP 'yesterday'"):
        replay.load_trace([tmp_path / "bad2.csv"])


def test_prefix_hit_rate_of_a_trace():
    a = traffic.parse_record({**GOOD, "t": 1.0, "prefix_hashes": ["a", "b"]}, "x")
    b = traffic.parse_record({**GOOD, "t": 2.0, "prefix_hashes": ["a", "c"]}, "x")
    c = traffic.parse_record({**GOOD, "t": 3.0, "prefix_hashes": ["d", "b"]}, "x")  # b alone is no hit
    assert prefix_hit_rate([a, b, c]) == pytest.approx(16 / 120)


def test_speed_parsing():
    assert replay.parse_speed("2x") == 2.0 and replay.parse_speed("0.5") == 0.5
    for bad in ("fast", "0x", "-1", "infx"):
        with pytest.raises(argparse.ArgumentTypeError):
            replay.parse_speed(bad)


# ----------------------------------------------------------------------------- writing

class _Params:
    temperature, max_tokens, n, stop, structured_outputs = 0.0, 8, 1, None, None


def pending(i: int, prompt=None) -> traffic.Pending:
    return traffic.Pending(arrival=1000.0 + i, endpoint="completions", model="m",
                           prompt=prompt if prompt is not None else list(range(40)), stream=False, status=200,
                           block_size=16, params=_Params(), output_tokens=8, finish_reason="length")


def test_recorder_writes_valid_records_and_rotates_by_size(tmp_path):
    path = tmp_path / "trace.jsonl"
    rec = TrafficRecorder(RecordSettings(path, max_bytes=4096, keep=2))
    for i in range(60):
        rec.submit(pending(i))
    rec.close()
    parts = sorted(tmp_path.iterdir())
    assert [p.name for p in parts] == ["trace.jsonl", "trace.jsonl.1", "trace.jsonl.2"]  # older ones dropped
    assert all(p.stat().st_size <= 4096 for p in parts)
    trace = read_trace(parts)  # every part starts with its own header
    assert len(trace.records) < 60 and trace.records[-1].t == 1059.0
    r = trace.records[0].raw
    assert r["prompt_tokens"] == 40 and len(r["prefix_hashes"]) == 2 and "text" not in r
    assert r["sampling"] == {"temperature": 0.0} and r["finish_reason"] == "length"


def test_recorder_never_blocks_the_caller(tmp_path, monkeypatch):
    gate = threading.Event()
    real = traffic.make_record
    monkeypatch.setattr(traffic, "make_record", lambda p: (gate.wait(), real(p))[1])
    rec = TrafficRecorder(RecordSettings(tmp_path / "t.jsonl", queue_size=2))
    start = time.perf_counter()
    for i in range(50):
        rec.submit(pending(i))
    assert time.perf_counter() - start < 0.5 and rec.dropped >= 47
    gate.set()
    rec.close()
    assert rec.written == 50 - rec.dropped


def test_text_prompts_are_tokenized_by_the_writer(tmp_path):
    rec = TrafficRecorder(RecordSettings(tmp_path / "t.jsonl", record_text=True))
    p = pending(0, prompt="hello world")
    p.tokenize = lambda text: list(range(len(text) * 3))  # 33 ids
    p.text = {"prompt": "hello world", "outputs": ["!"]}
    p.status, p.output_tokens, p.error = 429, 0, "queue_full"
    rec.submit(p)
    rec.close()
    r = read_trace(tmp_path / "t.jsonl").records[0]
    assert (r.prompt_tokens, len(r.prefix_hashes), r.status) == (33, 2, 429)
    assert r.raw["text"] == {"prompt": "hello world", "outputs": ["!"]} and r.raw["error"] == "queue_full"


def test_record_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="at least 4KiB"):
        RecordSettings(tmp_path / "t", max_bytes=10)
    with pytest.raises(ConfigError, match="is a folder"):
        RecordSettings(tmp_path)


# ----------------------------------------------------------------------------- SLO

def test_slo_parsing_and_checks():
    slo = SLOSpec.parse("ttft_p95<=1s, itl_p50<=50ms")
    assert str(slo) == "ttft_p95<=1s,itl_p50<=50ms" and slo.limit("itl") == 0.05
    run = {"completed": 5, "ttft_s": {"p95": 0.8}, "itl_s": {"p50": 0.06}}
    assert slo.check_run(run) == (False, "itl_p50 60ms > 50ms")
    assert slo.check_run({**run, "itl_s": {"p50": 0.04}}) == (True, "meets SLO")
    live = slo.check_live({"seconds": 60, "ttft_ms": {"p95": 1200.0}, "itl_ms": {"p50": 20.0}})
    assert live["fits"] is False and [o["ok"] for o in live["objectives"]] == [False, True]
    assert SLOSpec.parse("ttft_p99<=2s").check_live({"ttft_ms": {"p99": None}})["fits"] is None
    for bad, message in (("ttft<=1s", "cannot read"), ("ttft_p42<=1s", "percentiles"), ("", "at least one"),
                         ("ttft_p95<=1s,ttft_p95<=2s", "twice"), ("speed_p50<=1s", "cannot read")):
        with pytest.raises(ConfigError, match=message):
            SLOSpec.parse(bad)


# ----------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from tessera.config import EngineConfig
    from tessera.engine.frontend.async_engine import AsyncLLMEngine
    from tessera.engine.llm_engine import LLMEngine
    from tessera.live_stats import LiveStats
    from tessera.models.loader import load_model
    from tessera.server.app import create_app

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")
    config = EngineConfig(model=str(folder), dtype="float32", max_model_len=256, max_num_seqs=16,
                          kv_cache_memory=512 * 2 * 2 * 2 * 16 * 4 * 16)
    live = LiveStats("tiny")
    engine = AsyncLLMEngine(config, engine=LLMEngine(config, loaded=load_model(folder, "float32")),
                            max_num_queued_requests=256, stat_loggers=[live])
    app = create_app(engine, ["tiny"], live=live, slo=SLOSpec.parse("ttft_p95<=5s,itl_p50<=1s"))
    try:
        with serve_in_thread(app) as url:
            yield url, app, folder
    finally:
        engine.shutdown()


def _record(app, path: Path) -> TrafficRecorder:
    recorder = TrafficRecorder(RecordSettings(path))
    app.state.tessera.recorder = recorder
    return recorder


def _stop(app, recorder: TrafficRecorder) -> None:
    app.state.tessera.recorder = None
    recorder.close()


def _gaps(records) -> list[float]:
    return [b.t - a.t for a, b in zip(records, records[1:])]


@pytest.mark.slow
def test_replayed_trace_reproduces_arrivals_lengths_and_prefix_sharing(tiny_server, tmp_path):
    url, app, folder = tiny_server
    target = Target(base_url=url, model="tiny")
    # The original traffic: questions over three shared documents, and unrelated prompts.
    sessions = shared_prefix_workload(48, seed=3, prefix_words=12, num_prefixes=3, suffix_words=(2, 8),
                                      output_tokens=(2, 24))
    sessions += random_workload(32, seed=4, input_words=(3, 20), output_tokens=(2, 24))
    for i, s in enumerate(sessions):
        s.session_id = i
    original = tmp_path / "original.jsonl"
    rec = _record(app, original)
    run = asyncio.run(run_open_loop(target, sessions, rate=6.0, seed=5, progress=False))
    _stop(app, rec)
    assert all(r.ok for r in run.results), [r.error for r in run.results if not r.ok][:3]
    recorded = read_trace(original).records
    assert len(recorded) == 80 and all(r.ok and r.prefix_hashes for r in recorded[:48] if r.prompt_tokens >= 16)

    synth = replay.PromptSynth(replay.load_tokenizer(str(folder), required=True), salt=1)
    plan = replay.plan_replay(recorded, synth, speed=1.0)
    replayed_path = tmp_path / "replayed.jsonl"
    rec = _record(app, replayed_path)
    out = asyncio.run(replay.run_replay(target, plan, progress=False))
    _stop(app, rec)
    assert all(r.ok for r in out.results)
    replayed = read_trace(replayed_path).records
    assert len(replayed) == len(recorded)

    arrivals = ks_2samp(_gaps(recorded), _gaps(replayed))
    prompts = ks_2samp([r.prompt_tokens for r in recorded], [r.prompt_tokens for r in replayed])
    outputs = ks_2samp([r.output_tokens for r in recorded], [r.output_tokens for r in replayed])
    assert arrivals.pvalue > 0.05 and prompts.pvalue > 0.05 and outputs.pvalue > 0.05, (arrivals, prompts, outputs)
    span = recorded[-1].t - recorded[0].t
    assert abs((replayed[-1].t - replayed[0].t) - span) < 0.1 * span + 0.5
    hit_a, hit_b = prefix_hit_rate(recorded), prefix_hit_rate(replayed)
    assert hit_a > 0.2 and abs(hit_a - hit_b) <= 0.05, (hit_a, hit_b)
    # The server's own prefix cache agrees with the hashes' story.
    cached_a = sum(r.cached_tokens or 0 for r in recorded) / sum(r.prompt_tokens for r in recorded)
    cached_b = sum(r.cached_tokens or 0 for r in replayed) / sum(r.prompt_tokens for r in replayed)
    assert abs(cached_a - cached_b) <= 0.05, (cached_a, cached_b)
    print(f"KS p: arrivals {arrivals.pvalue:.3f}, prompts {prompts.pvalue:.3f}, outputs {outputs.pvalue:.3f}; "
          f"hashed hit rate {hit_a:.3f} vs {hit_b:.3f}; engine hit rate {cached_a:.3f} vs {cached_b:.3f}")

    # The live view checks the same traffic against the server's SLO.
    live = httpx.get(f"{url}/v1/engine/live", params={"seconds": 60}).json()["models"][0]["slo"]
    assert live["slo"] == "ttft_p95<=5s,itl_p50<=1s" and live["fits"] is True
    assert {o["metric"] for o in live["objectives"]} == {"ttft_p95", "itl_p50"}


def test_replay_cli_against_the_server(tiny_server, tmp_path):
    from tessera.bench.cli import main

    url, app, folder = tiny_server
    trace = write_trace(tmp_path / "t.jsonl", *({**GOOD, "t": 100.0 + i * 0.2, "model": "tiny",
                                                 "prefix_hashes": ["%016x" % (i % 2)], "prompt_tokens": 20}
                                                for i in range(6)))
    out = tmp_path / "replay.json"
    assert main(["replay", str(trace), "--base-url", url, "--model", "tiny", "--tokenizer", str(folder),
                 "--speed", "2x", "--no-progress", "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    summary = doc["runs"][0]["summary"]
    assert doc["kind"] == "tessera-bench-replay" and summary["completed"] == 6
    assert [r["prompt_tokens"] for r in doc["runs"][0]["requests"]] == [20] * 6
    assert doc["config"]["exact_lengths"] and (tmp_path / "replay_throughput.png").exists()
    md = tmp_path / "summary.md"  # a replay is a row of `bench report`'s table, beside serve runs
    assert main(["report", str(out), "--output", str(md), "--plot", str(tmp_path / "cmp.png")]) == 0
    assert "| replay of t.jsonl | replay 2x |" in md.read_text() and (tmp_path / "cmp.png").exists()
    bad = write_trace(tmp_path / "future.jsonl", GOOD, head={"format": "tessera-traffic", "version": 9})
    assert main(["replay", str(bad), "--base-url", url, "--model", "tiny"]) == 2


def test_serve_flags_make_the_recording_and_slo_settings(tmp_path):
    from tessera.cli import build_parser
    from tessera.server.config import ServingSpec

    parse = build_parser(with_bench=False).parse_args
    spec = ServingSpec.from_args(parse(["serve", "smollm2-135m", "--record-traffic", str(tmp_path / "t.jsonl"),
                                        "--record-text", "--record-traffic-max-size", "1MiB",
                                        "--record-traffic-keep", "2", "--slo", "ttft_p95<=1s"]))
    assert spec.record == RecordSettings(tmp_path / "t.jsonl", record_text=True, max_bytes=1 << 20, keep=2)
    assert str(spec.slo) == "ttft_p95<=1s"
    assert ServingSpec.from_args(parse(["serve", "smollm2-135m"])).record is None
    with pytest.raises(ConfigError, match="cannot read"):
        ServingSpec.from_args(parse(["serve", "smollm2-135m", "--slo", "fast"]))
