"""`tessera bench serve` against a fake OpenAI-compatible server whose timings are known.

The fake server streams tokens with fixed delays (first token after TTFT, then one
every ITL), so the client's measurements can be checked against the truth.
"""
from __future__ import annotations

import asyncio
import functools
import json
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import pytest
from aiohttp import web

from tessera.bench import capacity as capacity_mod
from tessera.bench import report, serve
from tessera.bench.client import RequestResult
from tessera.bench.datasets import Session, Turn, build_workload, random_workload
from tessera.bench.metrics import SLO, summarize
from tessera.bench.runner import Target, poisson_arrivals, run_closed_loop, run_open_loop


@dataclass
class FakeBehaviour:
    ttft: float = 0.08
    itl: float = 0.02
    slow_ttft: Optional[float] = None  # used for every other request when set
    fail_every: int = 0  # every Nth request answers HTTP 500
    send_usage: bool = True
    tokens_per_chunk: int = 1
    # A model that takes at most `big_limit` requests at once: past it, 429, or an answer from
    # `fallback` with Tessera's headers when one is set.
    big_limit: int = 0
    fallback: Optional[str] = None


@dataclass
class FakeState:
    behaviour: FakeBehaviour = field(default_factory=FakeBehaviour)
    bodies: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    count: int = 0
    big_in_flight: int = 0


class FakeServer:
    """An aiohttp app on a free loopback port, run in its own thread and event loop."""

    def __init__(self) -> None:
        self.state = FakeState()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def reset(self, **behaviour) -> FakeState:
        self.state = FakeState(FakeBehaviour(**behaviour))
        return self.state

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        st = self.state
        body = await request.json()
        st.bodies.append(body)
        st.count += 1
        n = st.count
        b = st.behaviour
        if b.fail_every and n % b.fail_every == 0:
            return web.json_response({"error": {"message": f"boom {n}"}}, status=500)
        headers = {"Content-Type": "text/event-stream", "x-tessera-model": body["model"]}
        big = b.big_limit and body["model"] == "big"
        if big and st.big_in_flight >= b.big_limit:
            if b.fallback is None:
                return web.json_response({"error": {"message": "queue full", "code": 429}}, status=429)
            headers.update({"x-tessera-model": b.fallback, "x-tessera-fallback-cause": "queue_full"})
            big = False
        st.in_flight += 1
        st.big_in_flight += bool(big)
        st.max_in_flight = max(st.max_in_flight, st.in_flight)
        try:
            resp = web.StreamResponse(headers=headers)
            await resp.prepare(request)

            async def send(obj) -> None:
                await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

            if chat:  # role-only first chunk, as OpenAI sends: must not count as the first token
                await send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            ttft = b.slow_ttft if (b.slow_ttft is not None and n % 2 == 0) else b.ttft
            await asyncio.sleep(ttft)
            total = int(body["max_tokens"])
            sent = 0
            while sent < total:
                k = min(b.tokens_per_chunk, total - sent)
                piece = "".join(f" t{sent + j}" for j in range(k))
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                await send({"choices": [choice]})
                sent += k
                if sent < total:
                    await asyncio.sleep(b.itl)
            if b.send_usage and body.get("stream_options", {}).get("include_usage"):
                await send({"choices": [], "usage": {"prompt_tokens": len(str(body).split()),
                                                     "completion_tokens": total, "total_tokens": total}})
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            st.in_flight -= 1
            st.big_in_flight -= bool(big)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", functools.partial(self._handle, chat=False))
        app.router.add_post("/v1/chat/completions", functools.partial(self._handle, chat=True))
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def server():
    with FakeServer() as s:
        yield s


def fixed_sessions(n: int, tokens: int) -> list[Session]:
    return [Session(i, [Turn(f"prompt {i} words words", tokens)]) for i in range(n)]


def target(server: FakeServer, **kw) -> Target:
    return Target(base_url=server.url, model="fake", **kw)


def test_closed_loop_measures_known_timings(server):
    st = server.reset(ttft=0.08, itl=0.02)
    run = asyncio.run(run_closed_loop(target(server), fixed_sessions(6, 6), 1, progress=False))
    s = summarize(run.results, run.duration, SLO())
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["output_tokens"] == 36 and s["usage_reported"]
    assert s["ttft_s"]["p50"] == pytest.approx(0.08, abs=0.03)
    assert s["itl_s"]["p50"] == pytest.approx(0.02, abs=0.008)
    assert s["itl_s"]["count"] == 6 * 5
    assert s["tpot_s"]["p50"] == pytest.approx(0.02, abs=0.008)
    expected_e2e = 0.08 + 5 * 0.02
    assert s["e2e_s"]["p50"] == pytest.approx(expected_e2e, abs=0.04)
    # One at a time: throughput is tokens over the sum of the requests' latencies.
    assert s["output_tokens_per_s"] == pytest.approx(6 / expected_e2e, rel=0.3)
    assert s["requests_per_s"] == pytest.approx(1 / expected_e2e, rel=0.3)
    assert s["goodput"] == 1.0
    assert st.max_in_flight == 1
    body = st.bodies[0]
    assert body["ignore_eos"] is True and body["max_tokens"] == 6 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_concurrency_keeps_n_in_flight_and_scales_throughput(server):
    def one_client() -> float:
        server.reset(ttft=0.05, itl=0.02)
        one = asyncio.run(run_closed_loop(target(server), fixed_sessions(4, 5), 1, progress=False))
        return summarize(one.results, one.duration, SLO())["output_tokens_per_s"]

    t1 = max(one_client(), one_client())  # the better of two: a busy machine only ever slows a run
    st = server.reset(ttft=0.05, itl=0.02)
    four = asyncio.run(run_closed_loop(target(server), fixed_sessions(16, 5), 4, progress=False))
    assert st.max_in_flight == 4
    t4 = summarize(four.results, four.duration, SLO())["output_tokens_per_s"]
    assert 2.5 < t4 / t1 < 4.8


def test_failures_are_counted_with_their_messages(server):
    server.reset(ttft=0.01, itl=0.005, fail_every=3)
    run = asyncio.run(run_closed_loop(target(server), fixed_sessions(9, 3), 2, progress=False))
    s = summarize(run.results, run.duration, SLO())
    assert s["failed"] == 3 and s["completed"] == 6
    assert all(e.startswith("HTTP 500") and "boom" in e for e in s["errors"])
    assert s["goodput"] == pytest.approx(6 / 9)


def test_unreachable_server_is_a_failure_not_a_crash():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t = Target(base_url=f"http://127.0.0.1:{port}", model="x")
    run = asyncio.run(run_closed_loop(t, fixed_sessions(2, 3), 1, progress=False))
    assert [r.ok for r in run.results] == [False, False]
    assert "Connect" in run.results[0].error or "connect" in run.results[0].error


def test_tokens_counted_from_chunks_without_usage_and_from_usage_with_it(server):
    server.reset(ttft=0.01, itl=0.005, send_usage=False)
    run = asyncio.run(run_closed_loop(target(server), fixed_sessions(2, 7), 1, progress=False))
    assert [r.output_tokens for r in run.results] == [7, 7]
    assert not any(r.usage_reported for r in run.results)
    # Three tokens per chunk: usage is the truth, chunks would undercount.
    server.reset(ttft=0.01, itl=0.005, tokens_per_chunk=3)
    run = asyncio.run(run_closed_loop(target(server), fixed_sessions(2, 7), 1, progress=False))
    assert [r.output_tokens for r in run.results] == [7, 7]
    assert [len(r.itls) for r in run.results] == [2, 2]


def test_goodput_applies_ttft_and_median_itl(server):
    server.reset(ttft=0.02, itl=0.01, slow_ttft=0.4)  # every other request starts slowly
    run = asyncio.run(run_closed_loop(target(server), fixed_sessions(8, 4), 1, progress=False))
    s = summarize(run.results, run.duration, SLO(ttft=0.2, itl=0.05))
    assert s["goodput"] == pytest.approx(0.5)
    assert s["ttft_s"]["p95"] == pytest.approx(0.4, abs=0.08)
    s = summarize(run.results, run.duration, SLO(ttft=5.0, itl=0.002))
    assert s["goodput"] == 0.0


def test_chat_multi_turn_resends_the_conversation(server):
    st = server.reset(ttft=0.01, itl=0.002)
    sessions = build_workload("multi-turn", 6, seed=3, output_tokens=(3, 3), turns=3)
    assert len(sessions) == 2
    run = asyncio.run(run_closed_loop(target(server), sessions, 2, progress=False))
    assert len(run.results) == 6 and all(r.ok for r in run.results)
    assert all(r.ttft >= 0.009 for r in run.results)  # the role-only chunk is not a token
    by_len = sorted(len(b["messages"]) for b in st.bodies)
    assert by_len == [2, 2, 4, 4, 6, 6]  # system + (user, assistant)* + user
    third = next(b for b in st.bodies if len(b["messages"]) == 6)
    assert third["messages"][2] == {"role": "assistant", "content": " t0 t1 t2"}


def test_open_loop_follows_seeded_poisson_arrivals(server):
    a = poisson_arrivals(2000, 4.0, seed=1)
    assert a == poisson_arrivals(2000, 4.0, seed=1) and a != poisson_arrivals(2000, 4.0, seed=2)
    assert statistics.mean(b - x for x, b in zip(a, a[1:])) == pytest.approx(0.25, rel=0.1)
    st = server.reset(ttft=0.2, itl=0.01)
    run = asyncio.run(run_open_loop(target(server), fixed_sessions(6, 2), float("inf"), seed=0, progress=False))
    assert st.max_in_flight == 6 and all(r.ok for r in run.results)
    st = server.reset(ttft=0.01, itl=0.005)
    t0 = time.perf_counter()
    run = asyncio.run(run_open_loop(target(server), fixed_sessions(5, 2), 20.0, seed=0, progress=False))
    starts = sorted(r.start - run.started for r in run.results)
    expected = poisson_arrivals(5, 20.0, seed=0)
    assert starts == pytest.approx(expected, abs=0.03)
    assert time.perf_counter() - t0 < 5


def test_open_loop_time_limit_counts_unfinished_as_failed(server):
    server.reset(ttft=2.0, itl=0.01)
    run = asyncio.run(run_open_loop(target(server), fixed_sessions(3, 2), float("inf"), seed=0,
                                    progress=False, drain_timeout=0.3))
    assert len(run.results) == 3 and not any(r.ok for r in run.results)
    assert "after the last arrival" in run.results[0].error and run.duration < 1.5


def test_open_loop_time_limit_follows_the_arrival_span(server):
    # A slow rate spreads arrivals past the drain timeout; requests that the server answers
    # promptly must not be cut because the client's clock started with the first arrival.
    server.reset(ttft=0.05, itl=0.005)
    sessions = fixed_sessions(4, 2)
    span = poisson_arrivals(4, 4.0, seed=2)[-1]
    assert span > 1.0
    run = asyncio.run(run_open_loop(target(server), sessions, 4.0, seed=2, progress=False, drain_timeout=0.4))
    assert len(run.results) == 4 and all(r.ok for r in run.results), [r.error for r in run.results]


def test_summary_percentiles_are_exact_on_known_values():
    results = [RequestResult(ok=True, ttft=t, e2e=t + 1.0, itls=[0.01 * (i + 1)] * 4, output_tokens=5)
               for i, t in enumerate([0.1 * k for k in range(1, 11)])]
    results.append(RequestResult(ok=False, error="HTTP 503: busy"))
    s = summarize(results, duration=10.0, slo=SLO(ttft=0.55, itl=0.045))
    assert s["ttft_s"]["p50"] == pytest.approx(0.55)
    assert s["ttft_s"]["p95"] == pytest.approx(0.955)
    assert s["ttft_s"]["p99"] == pytest.approx(0.991)
    assert s["ttft_s"]["mean"] == pytest.approx(0.55)
    assert s["tpot_s"]["p50"] == pytest.approx(0.25)
    assert s["output_tokens_per_s"] == pytest.approx(5.0) and s["requests_per_s"] == pytest.approx(1.0)
    assert s["failed"] == 1 and s["errors"] == ["HTTP 503: busy"]
    # TTFT ≤ 0.55 → first 5; median ITL ≤ 0.045 → first 4: 4 of 11 requests.
    assert s["goodput"] == pytest.approx(4 / 11)


def test_datasets_are_seeded_and_shaped():
    a = random_workload(50, seed=5)
    assert [t.prompt for s in a for t in s.turns] == [t.prompt for s in random_workload(50, seed=5) for t in s.turns]
    assert a[0].turns[0].prompt != random_workload(50, seed=6)[0].turns[0].prompt
    words = [len(s.turns[0].prompt.split()) for s in a]
    assert min(words) >= 50 and max(words) <= 400
    assert all(16 <= s.turns[0].max_tokens <= 256 for s in a)
    shared = build_workload("shared-prefix", 8, seed=1, prefix_words=100, num_prefixes=2)
    heads = {s.turns[0].prompt.split("\n\n")[0] for s in shared}
    assert len(heads) == 2 and len({s.turns[0].prompt for s in shared}) == 8
    with pytest.raises(ValueError):
        build_workload("nope", 4, seed=0)


def run_cli(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="tessera bench")
    sub = parser.add_subparsers(required=True)
    serve.add_parser(sub)
    capacity_mod.add_parser(sub)
    report.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.mark.slow
def test_serve_command_writes_json_and_plots(server, tmp_path, capsys):
    server.reset(ttft=0.02, itl=0.005)
    out = tmp_path / "fake.json"
    rc = run_cli(["serve", "--base-url", server.url, "--model", "fake", "--concurrency", "1,2",
                  "--num-prompts", "3,4", "--max-tokens", "4:6", "--prompt-words", "5:10", "--label", "fake",
                  "--no-progress", "--output", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "tessera-bench-serve" and doc["machine"]["cores"] >= 1
    assert doc["machine"]["server_label"] == "fake" and doc["config"]["dataset"] == "random"
    assert [r["load"]["name"] for r in doc["runs"]] == ["c=1", "c=2"]
    assert [r["summary"]["num_requests"] for r in doc["runs"]] == [3, 4]
    assert doc["runs"][0]["seed"] != doc["runs"][1]["seed"]
    for suffix in ("throughput", "latency", "ttft_cdf"):
        png = tmp_path / f"fake_{suffix}.png"
        assert png.stat().st_size > 5000
    md = tmp_path / "table.md"
    assert run_cli(["report", str(out), "--output", str(md), "--plot", str(tmp_path / "cmp.png")]) == 0
    table = md.read_text()
    assert "| fake | random | c=2 |" in table and (tmp_path / "cmp.png").exists()
    # runs of two models in one table (benchmarks/peer_table.sh): the workload cell names the model
    other = json.loads(out.read_text())
    other["config"]["model"] = "other"
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert run_cli(["report", str(out), str(tmp_path / "other.json"), "--output", str(md)]) == 0
    table = md.read_text()
    assert "| fake | fake random | c=2 |" in table and "| fake | other random | c=1 |" in table


@pytest.mark.slow
@pytest.mark.parametrize("fallback", [None, "small"])
def test_model_mix_is_seeded_and_broken_down_by_who_answered(server, tmp_path, fallback):
    """`--model big=3,small=1`: sessions draw their model (seeded), the big model's overflow is
    counted as 429s, or as degraded answers with their cause when the server falls back."""
    server.reset(ttft=0.05, itl=0.005, big_limit=2, fallback=fallback)
    out = tmp_path / "mix.json"
    rc = run_cli(["serve", "--base-url", server.url, "--model", "big=3,small=1", "--concurrency", "6",
                  "--num-prompts", "40", "--max-tokens", "4", "--prompt-words", "5", "--no-progress",
                  "--output", str(out)])
    assert rc == 0
    asked = [b["model"] for b in server.state.bodies]
    assert set(asked) == {"big", "small"} and asked.count("big") > asked.count("small")
    run = json.loads(out.read_text())["runs"][0]
    m = run["models"]
    assert m["asked"]["big"]["requests"] + m["asked"]["small"]["requests"] == 40
    assert m["asked"]["small"]["answered_by"] == {"small": m["asked"]["small"]["requests"]}
    big = m["asked"]["big"]
    if fallback is None:
        assert big["rejected_429"] > 0 and run["summary"]["rejected_429"] == big["rejected_429"]
        assert big["answered_by"] == {"big": big["completed"]} and m["degraded"]["requests"] == 0
    else:
        assert big["rejected_429"] == 0 and big["answered_by"]["small"] > 0
        assert m["degraded"] == {**m["degraded"], "requests": big["answered_by"]["small"],
                                 "causes": {"queue_full": big["answered_by"]["small"]}, "within_slo": 1.0}
        assert [r["fallback_cause"] for r in run["requests"] if r["served_model"] != r["model"]]
    assert m["answered"]["big"]["ttft_s"]["p50"] >= 0.05
    # The same seed asks the same models in the same order on another run.
    server.reset(ttft=0.01, itl=0.001)
    assert run_cli(["serve", "--base-url", server.url, "--model", "big=3,small=1", "--concurrency", "1",
                    "--num-prompts", "40", "--max-tokens", "1", "--prompt-words", "5", "--no-progress",
                    "--warmup", "0"]) == 0
    assert [b["model"] for b in server.state.bodies] == [r["model"] for r in sorted(
        run["requests"], key=lambda r: r["session"])]


def test_model_mix_argument_is_validated():
    from tessera.bench.options import model_mix

    assert model_mix("m") == [("m", 1.0)]
    assert model_mix("a=3, b=1") == [("a", 0.75), ("b", 0.25)]
    for bad in ("a=0", "a=x", "=2", "a,a", ",", "a=inf"):
        with pytest.raises(Exception):
            model_mix(bad)


def test_capacity_command_against_a_fast_server(server, tmp_path):
    server.reset(ttft=0.01, itl=0.002)
    out = tmp_path / "cap.json"
    rc = run_cli(["capacity", "--base-url", server.url, "--model", "fake", "--start-rate", "4",
                  "--max-rate", "8", "--max-probes", "3", "--probe-duration", "0.5", "--min-requests", "3",
                  "--max-tokens", "3", "--prompt-words", "5", "--no-progress", "--output", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["capacity_requests_per_s"] == 8.0 and [p["rate"] for p in doc["probes"]] == [4.0, 8.0]
    assert "largest rate" in doc["note"]
    assert (tmp_path / "cap_capacity.png").stat().st_size > 5000


def test_add_bench_subparsers_registers_serve_and_capacity():
    import argparse

    from tessera.bench.cli import add_bench_subparsers

    parser = argparse.ArgumentParser()
    add_bench_subparsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "serve", "--base-url", "http://x", "--model", "m",
                              "--request-rate", "1,inf", "--max-tokens", "8:8"])
    assert args.func is serve.main and args.request_rate == [1.0, float("inf")] and args.max_tokens == (8, 8)
    args = parser.parse_args(["bench", "capacity", "--base-url", "http://x", "--model", "m", "--slo-ttft", "2"])
    assert args.func is capacity_mod.main and args.slo_ttft == 2.0 and args.slo_itl == 0.05
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "serve", "--base-url", "http://x", "--model", "m", "--concurrency", "0"])


def test_max_active_conversations_interleaves_turns_round_robin(server):
    """Multi-turn with --max-active-conversations: conversations take turns (a conversation's next
    turn waits behind the other active ones'), each turn still resends its whole conversation, and
    no more than N conversations are under way at once."""
    server.reset(ttft=0.005, itl=0.001)
    sessions = build_workload("multi-turn", 5 * 3, seed=3, output_tokens=(2, 2), turns=3)
    assert len(sessions) == 5
    run = asyncio.run(run_closed_loop(target(server), sessions, 1, progress=False, max_active_conversations=3))
    assert all(r.ok for r in run.results) and len(run.results) == 15
    order = [(r.session_id, r.turn) for r in run.results]
    ids = [s.session_id for s in sessions]
    assert order[:6] == [(ids[0], 0), (ids[1], 0), (ids[2], 0), (ids[0], 1), (ids[1], 1), (ids[2], 1)]
    under_way, most = set(), 0
    for sid, turn in order:
        under_way.add(sid)
        most = max(most, len(under_way))
        if turn == 2:
            under_way.discard(sid)
    assert most == 3
    for body in server.state.bodies:  # turn k carries k earlier exchanges
        users = [m for m in body["messages"] if m["role"] == "user"]
        assistants = [m for m in body["messages"] if m["role"] == "assistant"]
        assert len(assistants) == len(users) - 1
    server.reset(ttft=0.005, itl=0.001)
    run = asyncio.run(run_closed_loop(target(server), sessions, 2, progress=False, max_active_conversations=4))
    assert sorted((r.session_id, r.turn) for r in run.results) == sorted((i, t) for i in ids for t in range(3))
    with pytest.raises(Exception):
        run_cli(["serve", "--base-url", server.url, "--model", "m", "--request-rate", "1",
                 "--max-active-conversations", "2", "--dataset", "multi-turn", "--no-progress"])
