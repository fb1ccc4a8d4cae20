"""`tessera bench capacity`: the highest Poisson request rate that still meets the latency SLO.

The method of the source articles: replay a representative mix at increasing load,
watch throughput, queueing and latency together, keep the highest load that meets the
goals. The search is bounded: the rate grows geometrically from --start-rate until a
probe misses the SLO (or shrinks until one meets it), then bisects between the highest
passing and lowest failing rates until they are within --rel-tol or --max-probes is spent.
It assumes latency grows with rate; on a noisy machine the answer is as noisy as one probe.
"""
from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from rich.console import Console
from rich.table import Table

from tessera.bench import options
from tessera.bench.datasets import requests_per_session
from tessera.bench.machine import machine_info
from tessera.bench.metrics import SLO, summarize
from tessera.bench.runner import run_open_loop
from tessera.bench.serve import make_console, request_records, warm_up, write_outputs
from tessera.errors import TesseraError


@dataclass
class Probe:
    rate: float
    passed: bool
    reason: str
    summary: dict[str, Any]
    requests: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class CapacityResult:
    rate: Optional[float]  # highest passing rate found; None if even --min-rate missed the SLO
    probes: list[Probe]
    bracket: tuple[Optional[float], Optional[float]]  # (highest pass, lowest fail)
    note: str = ""


def check_slo(summary: dict[str, Any], slo: SLO, max_failure_share: float = 0.0) -> tuple[bool, str]:
    """A probe passes when P95 TTFT ≤ slo.ttft, pooled P50 ITL ≤ slo.itl and few enough requests failed."""
    n = summary["num_requests"]
    if summary["completed"] == 0:
        return False, "no request completed"
    if n and summary["failed"] / n > max_failure_share:
        return False, f"{summary['failed']}/{n} failed"
    ttft = summary["ttft_s"]["p95"]
    if ttft is not None and ttft > slo.ttft:
        return False, f"TTFT p95 {ttft:.3g}s > {slo.ttft:g}s"
    itl = summary["itl_s"]["p50"]
    if itl is not None and itl > slo.itl:
        return False, f"ITL p50 {itl * 1000:.3g}ms > {slo.itl * 1000:g}ms"
    return True, "meets SLO"


def search_capacity(probe: Callable[[float], Probe], *, start_rate: float = 0.5, growth: float = 2.0,
                    max_probes: int = 8, min_rate: float = 0.05, max_rate: float = 1000.0,
                    rel_tol: float = 0.1) -> CapacityResult:
    """Bounded exponential-then-bisection search over rates with a pass/fail `probe`."""
    if not (growth > 1):
        raise ValueError("growth factor must be greater than 1")
    if max_probes < 1:
        raise ValueError("need at least one probe")
    if not (0 < min_rate <= start_rate <= max_rate):
        raise ValueError("need 0 < min rate <= start rate <= max rate")
    probes: list[Probe] = []
    lo: Optional[float] = None  # highest rate seen to pass
    hi: Optional[float] = None  # lowest rate seen to fail

    def run(rate: float) -> bool:
        p = probe(rate)
        probes.append(p)
        return p.passed

    rate = start_rate
    note = ""
    # Phase 1: bracket the threshold geometrically.
    while len(probes) < max_probes:
        if run(rate):
            lo = rate
            if hi is not None:
                break
            if rate >= max_rate:
                note = f"met the SLO at the largest rate allowed (--max-rate {max_rate:g})"
                break
            rate = min(rate * growth, max_rate)
        else:
            hi = rate
            if lo is not None:
                break
            if rate <= min_rate:
                note = f"missed the SLO even at the smallest rate allowed (--min-rate {min_rate:g})"
                break
            rate = max(rate / growth, min_rate)
    # Phase 2: bisect the bracket.
    while lo is not None and hi is not None and len(probes) < max_probes and (hi - lo) / lo > rel_tol:
        mid = (lo + hi) / 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    if not note and len(probes) >= max_probes and (lo is None or hi is None or (hi - lo) / lo > rel_tol):
        note = f"stopped after --max-probes {max_probes}; the threshold lies in the bracket"
    return CapacityResult(rate=lo, probes=probes, bracket=(lo, hi), note=note)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "capacity", help="find the highest request rate that meets the TTFT/ITL SLO",
        description="Search Poisson request rates (geometric growth, then bisection) for the highest "
                    "rate whose P95 TTFT and P50 ITL meet the SLO; prints the rate and the curve behind it.")
    options.add_target_args(p)
    options.add_workload_args(p)
    g = p.add_argument_group("search")
    g.add_argument("--start-rate", type=options.positive_float, default=0.5,
                   help="first rate probed, requests/s (default: %(default)s)")
    g.add_argument("--growth", type=options.positive_float, default=2.0,
                   help="factor between rates until the SLO is crossed (default: %(default)s)")
    g.add_argument("--max-probes", type=int, default=8, help="most probes in all (default: %(default)s)")
    g.add_argument("--min-rate", type=options.positive_float, default=0.05,
                   help="give up below this rate (default: %(default)s)")
    g.add_argument("--max-rate", type=options.positive_float, default=1000.0,
                   help="never probe above this rate (default: %(default)s)")
    g.add_argument("--rel-tol", type=options.positive_float, default=0.1,
                   help="stop when (fail − pass)/pass is below this (default: %(default)s)")
    g.add_argument("--probe-duration", type=options.positive_float, default=30.0,
                   help="seconds of arrivals per probe: sessions = rate × duration, each one request or, "
                        "multi-turn, --turns (default: %(default)s)")
    g.add_argument("--probe-timeout", type=options.positive_float, default=None,
                   help="cancel a probe's requests still unfinished this many seconds after its last "
                        "arrival; they count as failed (default: probe duration + 60)")
    g.add_argument("--min-requests", type=int, default=16, help="fewest requests per probe (default: %(default)s)")
    g.add_argument("--max-requests", type=int, default=400, help="most requests per probe (default: %(default)s)")
    g.add_argument("--max-failure-share", type=float, default=0.0,
                   help="share of failed requests a passing probe may have (default: %(default)s)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="cap on requests in flight during a probe (default: none)")
    o = p.add_argument_group("output")
    o.add_argument("--output", type=Path, help="write the search and every probe as JSON to this file")
    o.add_argument("--plot-dir", type=Path, help="write the PNG plot here (default: beside --output)")
    p.set_defaults(func=main)
    return p


def probe_requests(rate: float, duration: float, per_session: int, low: int, high: int) -> int:
    """Requests in one probe: `rate` sessions a second for `duration` seconds, `per_session`
    requests each (a multi-turn conversation's turns), kept between `low` and `high`. Counting
    sessions keeps a chat probe's arrivals as long as a single-turn one's; counting requests would
    end them after 1/turns of the duration, a probe too short to measure."""
    return max(low, min(high, math.ceil(rate * duration) * per_session))


def probes_for(args: argparse.Namespace, rate: float) -> int:
    return probe_requests(rate, args.probe_duration, requests_per_session(args.dataset, args.turns),
                          args.min_requests, args.max_requests)


def make_probe(args: argparse.Namespace, console: Console) -> Callable[[float], Probe]:
    target = options.target_from_args(args)
    slo = options.slo_from_args(args)
    count = [0]

    def probe(rate: float) -> Probe:
        i = count[0]
        count[0] += 1
        seed = args.seed + 1000 * i  # fresh prompts per probe: no help from the prefix cache
        n = probes_for(args, rate)
        sessions = options.workload_from_args(args, n, seed)
        grace = args.probe_timeout or args.probe_duration + 60
        run = asyncio.run(run_open_loop(target, sessions, rate, seed, max_concurrency=args.max_concurrency,
                                        progress=not args.no_progress, desc=f"probe {i + 1}: {rate:.3g}/s",
                                        drain_timeout=grace))
        summary = summarize(run.results, run.duration, slo)
        passed, reason = check_slo(summary, slo, args.max_failure_share)
        console.print(f"probe {i + 1}: {rate:.3g} req/s, {n} requests → "
                      f"{'[green]pass[/]' if passed else '[red]fail[/]'} ({reason})")
        return Probe(rate, passed, reason, summary, request_records(run))

    return probe


def probe_dict(p: Probe) -> dict[str, Any]:
    return {"rate": p.rate, "passed": p.passed, "reason": p.reason, "summary": p.summary, "requests": p.requests}


def curve_table(result: CapacityResult, title: str) -> Table:
    t = Table(title=title)
    for col in ("rate (req/s)", "requests", "achieved req/s", "out tok/s", "TTFT p50/p95 (s)",
                "ITL p50 (ms)", "goodput", "failed", "verdict"):
        t.add_column(col, justify="right")
    for p in sorted(result.probes, key=lambda p: p.rate):
        s = p.summary
        f = lambda v, k=1.0: "-" if v is None else f"{v * k:.3g}"  # noqa: E731
        t.add_row(f"{p.rate:.3g}", str(s["num_requests"]), f"{s['requests_per_s']:.3g}",
                  f"{s['output_tokens_per_s']:.4g}", f"{f(s['ttft_s']['p50'])}/{f(s['ttft_s']['p95'])}",
                  f(s["itl_s"]["p50"], 1000), f"{s['goodput']:.0%}", str(s["failed"]),
                  "pass" if p.passed else p.reason)
    return t


def main(args: argparse.Namespace) -> int:
    from tessera.bench.plots import plot_capacity

    console = make_console()
    target = options.target_from_args(args)
    failed = asyncio.run(warm_up(target, args.warmup, args.seed, chat=options.uses_chat(args),
                                 models=options.mix_models(args)))
    if failed is not None:
        raise TesseraError(f"cannot get a completion from {target.url(args.endpoint == 'chat')}: {failed.error}")
    try:
        result = search_capacity(make_probe(args, console), start_rate=args.start_rate, growth=args.growth,
                                 max_probes=args.max_probes, min_rate=args.min_rate, max_rate=args.max_rate,
                                 rel_tol=args.rel_tol)
    except ValueError as exc:
        raise TesseraError(str(exc)) from None
    slo = options.slo_from_args(args)
    title = f"{args.label or args.model}, {args.dataset}: SLO TTFT p95 ≤ {slo.ttft:g}s, ITL p50 ≤ {slo.itl * 1000:g}ms"
    console.print(curve_table(result, title))
    if result.rate is None:
        console.print(f"[red]no rate met the SLO[/] {result.note}")
    else:
        hi = result.bracket[1]
        console.print(f"capacity: [bold]{result.rate:.3g} req/s[/]"
                      + (f" (fails at {hi:.3g} req/s)" if hi is not None else "")
                      + (f"; {result.note}" if result.note else ""))
    config = options.workload_config(args)
    for k in ("start_rate", "growth", "max_probes", "min_rate", "max_rate", "rel_tol", "probe_duration",
              "probe_timeout", "min_requests", "max_requests", "max_failure_share", "max_concurrency"):
        config[k] = getattr(args, k)
    doc = {"kind": "tessera-bench-capacity", "version": 1, "label": args.label,
           "machine": machine_info(args.label), "config": config,
           "slo": {"ttft_p95_s": slo.ttft, "itl_p50_s": slo.itl},
           "capacity_requests_per_s": result.rate, "bracket": list(result.bracket), "note": result.note,
           "probes": [probe_dict(p) for p in result.probes]}
    slo_axes = {"ttft_s": slo.ttft, "itl_s": slo.itl}
    write_outputs(doc, args.output, args.plot_dir,
                  lambda prefix: [plot_capacity(doc["probes"], slo_axes, result.rate,
                                                prefix.with_name(prefix.name + "_capacity.png"), title)],
                  console)
    return 0
