"""`tessera bench serve`: replay a seeded workload against a server at several load levels.

Each level is a fresh run with its own seed (base seed + 1000 × level index), so a
server's prefix cache cannot serve one level's prompts from an earlier level.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from rich.console import Console
from rich.table import Table

from tessera.bench import options
from tessera.bench.client import RequestResult
from tessera.bench.datasets import random_workload
from tessera.bench.machine import machine_info
from tessera.bench.metrics import SLO, model_breakdown, summarize
from tessera.bench.runner import RunOutput, Target, run_closed_loop, run_open_loop
from tessera.errors import TesseraError

SEED_STRIDE = 1000


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve", help="measure TTFT, ITL, TPOT, latency and throughput of an OpenAI-compatible server",
        description="Stream a seeded workload to an OpenAI-compatible server (Tessera, vLLM, llama.cpp) "
                    "at each concurrency or request rate and report throughput, latency percentiles and goodput.")
    options.add_target_args(p)
    options.add_workload_args(p)
    g = p.add_argument_group("load")
    load = g.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=options.int_list, metavar="N[,N...]",
                      help="closed loop: requests kept in flight, e.g. 1,4,16,32 (default: 1)")
    load.add_argument("--request-rate", type=options.rate_list, metavar="R[,R...]",
                      help="open loop: Poisson arrivals per second, e.g. 0.5,1,2,inf")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="open loop: cap on requests in flight (default: none)")
    g.add_argument("--max-active-conversations", type=options.positive_int, default=None, metavar="N",
                   help="closed loop, multi-turn: keep N conversations under way and send their turns "
                        "round-robin, so a conversation's next turn waits behind the others' as a user "
                        "thinking does (default: each client runs one conversation to its end)")
    g.add_argument("--num-prompts", type=options.int_list, default=[64], metavar="N[,N...]",
                   help="requests per level; one value, or one per level (default: 64)")
    o = p.add_argument_group("output")
    o.add_argument("--output", type=Path, help="write results as JSON to this file")
    o.add_argument("--plot-dir", type=Path,
                   help="write PNG plots here (default: beside --output; none without either)")
    p.set_defaults(func=main)
    return p


def levels_from_args(args: argparse.Namespace) -> list[tuple[str, float]]:
    if args.request_rate:
        return [("request_rate", r) for r in args.request_rate]
    return [("concurrency", float(c)) for c in (args.concurrency or [1])]


def level_name(mode: str, value: float) -> str:
    if mode == "concurrency":
        return f"c={int(value)}"
    return "rate=inf" if math.isinf(value) else f"rate={value:g}/s"


def request_records(run: RunOutput) -> list[dict[str, Any]]:
    """Per-request numbers kept in the JSON, enough to redraw distributions later."""
    out = []
    for r in run.results:
        rec: dict[str, Any] = {"ok": r.ok, "start": round(r.start - run.started, 6), "ttft": r.ttft,
                               "e2e": r.e2e, "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens,
                               "max_tokens": r.max_tokens, "session": r.session_id, "turn": r.turn,
                               "status": r.status, "model": r.model, "served_model": r.served_model}
        if r.fallback_cause:
            rec["fallback_cause"] = r.fallback_cause
        if r.itls:
            rec["itl_p50"] = statistics.median(r.itls)
            rec["itl_max"] = max(r.itls)
        if r.tpot is not None:
            rec["tpot"] = r.tpot
        if r.ok:  # to compare replies across runs (greedy) without keeping them
            rec["text_sha256"] = hashlib.sha256(r.text.encode()).hexdigest()[:16]
        else:
            rec["error"] = r.error
        out.append(rec)
    return out


async def warm_up(target: Target, n: int, seed: int, chat: bool = False,
                  models: Sequence[str] = ()) -> Optional[RequestResult]:
    """Send `n` short unrelated requests to each of `models` (default: the target's), through the
    chat API when the workload uses it (a server's first chat request may pay for its template,
    and a multi-model server's first request to a model may load it: neither must land in a
    measurement); returns a failed result if none succeeded for some model."""
    if n <= 0:
        return None
    for model in models or [target.model]:
        sessions = random_workload(n, seed + 7_777_777, input_words=(16, 32), output_tokens=(8, 8))
        for s in sessions:
            s.chat = chat
            s.model = model
        run = await run_closed_loop(target, sessions, 1, progress=False)
        if not any(r.ok for r in run.results):
            return run.results[0]
    return None


async def run_level(target: Target, args: argparse.Namespace, mode: str, value: float, num_prompts: int,
                    seed: int, slo: SLO) -> dict[str, Any]:
    sessions = options.workload_from_args(args, num_prompts, seed)
    name = level_name(mode, value)
    progress = not args.no_progress
    if mode == "concurrency":
        run = await run_closed_loop(target, sessions, int(value), progress=progress, desc=name,
                                    max_active_conversations=args.max_active_conversations)
    else:
        run = await run_open_loop(target, sessions, value, seed, max_concurrency=args.max_concurrency,
                                  progress=progress, desc=name)
    out = {"load": {"mode": mode, "value": json_number(value), "name": name}, "seed": seed,
           "num_prompts": num_prompts, "summary": summarize(run.results, run.duration, slo),
           "requests": request_records(run)}
    if len(options.model_mix(args.model)) > 1 or any(r.fallback_cause for r in run.results):
        out["models"] = model_breakdown(run.results, run.duration, slo)
    return out


def make_console() -> Console:
    """Rich console; wide enough for the results table when output goes to a file or pipe."""
    return Console() if sys.stdout.isatty() else Console(width=160)


def _fmt(v: Optional[float], scale: float = 1.0, digits: int = 3) -> str:
    return "-" if v is None else f"{v * scale:.{digits}g}"


def results_table(runs: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for col in ("load", "req/s", "out tok/s", "TTFT p50/p95/p99 (s)", "ITL p50/p95 (ms)", "TPOT p50 (ms)",
                "e2e p50/p95 (s)", "goodput", "failed"):
        t.add_column(col, justify="right")
    for r in runs:
        s = r["summary"]
        t.add_row(r["load"]["name"], f"{s['requests_per_s']:.3g}", f"{s['output_tokens_per_s']:.4g}",
                  "/".join(_fmt(s["ttft_s"][k]) for k in ("p50", "p95", "p99")),
                  "/".join(_fmt(s["itl_s"][k], 1000) for k in ("p50", "p95")),
                  _fmt(s["tpot_s"]["p50"], 1000),
                  "/".join(_fmt(s["e2e_s"][k]) for k in ("p50", "p95")),
                  f"{s['goodput']:.0%}",
                  f"{s['failed']} ({s['rejected_429']} 429)" if s.get("rejected_429") else str(s["failed"]))
    return t


def models_table(runs: list[dict[str, Any]], title: str) -> Optional[Table]:
    """Per load level and model asked for: who answered, 429s, and the degraded answers' TTFT."""
    if not any("models" in r for r in runs):
        return None
    t = Table(title=title)
    for col in ("load", "model asked", "requests", "answered by", "429", "other failures",
                "TTFT p50/p95 (s) by answering model", "degraded: causes", "degraded TTFT p95", "degraded in SLO"):
        t.add_column(col, justify="right")
    for r in runs:
        m = r.get("models")
        if m is None:
            continue
        deg = m["degraded"]
        for i, (asked, a) in enumerate(sorted(m["asked"].items())):
            by = ", ".join(f"{who} {n}" for who, n in sorted(a["answered_by"].items())) or "-"
            lat = ", ".join(f"{who} {_fmt(m['answered'][who]['ttft_s']['p50'])}/{_fmt(m['answered'][who]['ttft_s']['p95'])}"
                            for who in sorted(a["answered_by"]))
            first = i == 0
            t.add_row(r["load"]["name"] if first else "", asked, str(a["requests"]), by, str(a["rejected_429"]),
                      str(a["failed"]), lat or "-",
                      (", ".join(f"{c} {n}" for c, n in sorted(deg["causes"].items())) or "-") if first else "",
                      _fmt(deg["ttft_s"]["p95"]) if first else "",
                      ("-" if deg["within_slo"] is None else f"{deg['within_slo']:.0%}") if first else "")
    return t


def write_outputs(doc: dict[str, Any], output: Optional[Path], plot_dir: Optional[Path],
                  plot: Any, console: Console) -> None:
    """JSON to `output`, PNGs via `plot(prefix)` under `plot_dir` (or beside `output`)."""
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
        console.print(f"results: {output}")
    folder = plot_dir or (output.parent if output is not None else None)
    if folder is None:
        return
    stem = output.stem if output is not None else (doc.get("label") or "bench")
    for path in plot(folder / stem):
        console.print(f"plot: {path}")


def json_number(v: float) -> float | str:
    """Infinity as the string "inf": strict JSON has no infinity, and float("inf") reads it back."""
    return "inf" if math.isinf(v) else v


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


async def run_sweep(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    target = options.target_from_args(args)
    slo = options.slo_from_args(args)
    levels = levels_from_args(args)
    if args.max_active_conversations is not None and args.request_rate:
        raise TesseraError("--max-active-conversations interleaves conversations in a closed loop (--concurrency); "
                           "with --request-rate each conversation arrives on its own")
    counts = args.num_prompts
    if len(counts) not in (1, len(levels)):
        raise TesseraError(f"--num-prompts: give one value or one per level ({len(levels)}), not {len(counts)}")
    failed = await warm_up(target, args.warmup, args.seed, chat=options.uses_chat(args),
                           models=options.mix_models(args))
    if failed is not None:
        raise TesseraError(f"cannot get a completion from {target.url(args.endpoint == 'chat')}: {failed.error}")
    runs = []
    for i, (mode, value) in enumerate(levels):
        n = counts[i] if len(counts) > 1 else counts[0]
        run = await run_level(target, args, mode, value, n, args.seed + SEED_STRIDE * i, slo)
        s = run["summary"]
        console.print(f"{run['load']['name']}: {s['output_tokens_per_s']:.1f} output tok/s, "
                      f"TTFT p95 {_fmt(s['ttft_s']['p95'])} s, ITL p50 {_fmt(s['itl_s']['p50'], 1000)} ms, "
                      f"goodput {s['goodput']:.0%}, failed {s['failed']}")
        for err in s["errors"][:3]:
            console.print(f"  error: {err}", style="red", markup=False)
        runs.append(run)
    config = options.workload_config(args)
    config.update(num_prompts=counts, max_concurrency=args.max_concurrency,
                  max_active_conversations=args.max_active_conversations,
                  levels=[{"mode": m, "value": json_number(v)} for m, v in levels])
    return {"kind": "tessera-bench-serve", "version": 1, "label": args.label,
            "machine": machine_info(args.label), "config": config, "runs": runs}


def main(args: argparse.Namespace) -> int:
    from tessera.bench.plots import plot_sweep  # matplotlib only when a run is made

    console = make_console()
    doc = asyncio.run(run_sweep(args, console))
    title = f"{args.label or args.model}, {args.dataset}"
    console.print(results_table(doc["runs"], title))
    by_model = models_table(doc["runs"], f"{title}: by model")
    if by_model is not None:
        console.print(by_model)
    write_outputs(doc, args.output, args.plot_dir, lambda prefix: plot_sweep(doc["runs"], prefix, title), console)
    return 0
