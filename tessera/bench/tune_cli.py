"""`tessera tune`'s command: its flags, the run (tessera/bench/tune.py's search), and what it
reports (the trials table, the plots, the JSON report and the tuned `--config`).
"""
from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from tessera.bench import options
from tessera.bench.machine import machine_info
from tessera.bench.serve import make_console
from tessera.bench.tune import (SYNTHETIC, Tuner, TrialResult, baseline_params, config_toml, engine_settings,
                                synthetic_workload, trace_workload)
from tessera.errors import TesseraError
from tessera.serve_flags import serve_parser
from tessera.slo import SLOSpec


# ----------------------------------------------------------------------------- report

def trials_table(results: list[TrialResult], baseline: Optional[TrialResult]) -> Any:
    from rich.table import Table

    t = Table(title="tessera tune: trials")
    for col in ("trial", "state", "capacity (req/s)", "vs default", "max_num_seqs", "token budget", "target ITL",
                "chunk", "prefix", "preempt", "spec", "KV", "RxT", "s"):
        t.add_column(col, justify="right")
    base = baseline.capacity if baseline is not None and baseline.capacity else None
    for r in sorted(results, key=lambda r: -(r.capacity or 0)):
        p = r.params
        cap = "-" if r.capacity is None else (f"{r.capacity:.3g}" if r.state == "complete" else f">={r.capacity:.3g}")
        t.add_row(str(r.number), r.state, cap,
                  "-" if base is None or r.capacity is None else f"{r.capacity / base:.2f}x",
                  str(p["max_num_seqs"]), str(p["max_num_batched_tokens"]), f"{p['target_itl_ms']:g}",
                  str(p.get("min_prefill_chunk", "-")), "on" if p["enable_prefix_caching"] else "off",
                  p["preemption_mode"], "off" if p["speculation"] == "off" else f"ngram k={p['num_speculative_tokens']}",
                  p["kv_cache_dtype"], p["topology"], f"{r.seconds:.0f}")
    return t


def plot_tuning(results: list[TrialResult], slo: SLOSpec, prefix: Path, title: str) -> list[Path]:
    """Capacity per trial, and every probe's P95 TTFT and P50 ITL against its throughput with the
    frontier of the passing probes (the most throughput at each latency)."""
    from tessera.bench.plots import plt

    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(8, 4.2))
    colors = {"complete": "tab:blue", "pruned": "tab:gray", "failed": "tab:red"}
    best = max((r.capacity or 0 for r in results if r.state == "complete"), default=0)
    for r in results:
        ax.bar(r.number, r.capacity or 0, color="tab:green" if r.capacity == best and best else colors[r.state],
               hatch="//" if r.state == "pruned" else None)
        if r.state == "pruned" and r.bracket[1] is not None:  # where it missed: its capacity is below
            ax.plot(r.number, r.bracket[1], "v", color="tab:red")
    ax.set_xticks([r.number for r in results])
    if results and results[0].number == 0 and results[0].capacity:
        ax.axhline(results[0].capacity, color="black", ls="--", lw=0.8, label="default profile")
        ax.legend(fontsize=8)
    ax.set_xlabel("trial (hatched: stopped early, capacity between the bar and the red mark)")
    ax.set_ylabel("capacity (req/s within SLO)")
    ax.set_title(f"Capacity per trial: {title}")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    paths.append(prefix.with_name(prefix.name + "_capacity.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    probes = [p for r in results for p in r.probes]
    for ax, metric, stat in zip(axes, ("ttft_s", "itl_s"), ("p95", "p50")):
        pts = [(p["summary"]["output_tokens_per_s"], p["summary"][metric][stat], p["passed"]) for p in probes
               if p["summary"][metric][stat] is not None]
        for passed, color in ((True, "tab:green"), (False, "tab:red")):
            xs = [x for x, _, ok in pts if ok == passed]
            ys = [y for _, y, ok in pts if ok == passed]
            ax.scatter(xs, ys, c=color, s=18, label="meets SLO" if passed else "misses SLO")
        frontier, top = [], -1.0
        for x, y, _ in sorted((q for q in pts if q[2]), key=lambda q: q[1]):
            if x > top:
                frontier.append((x, y))
                top = x
        if frontier:
            ax.step([x for x, _ in frontier], [y for _, y in frontier], where="post", color="tab:green", lw=1)
        limit = next((o.limit_s for o in slo.objectives if o.name == f"{metric[:-2]}_{stat}"), None)
        if limit is not None:
            ax.axhline(limit, color="red", ls="--", lw=0.8, label="SLO")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{metric[:-2].upper()} {stat.upper()} (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Latency against throughput, every probe of every trial: {title}")
    fig.tight_layout()
    paths.append(prefix.with_name(prefix.name + "_frontier.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


# ----------------------------------------------------------------------------- command

def _fixed_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--set wants KEY=VALUE (an engine option), not {text!r}")
    v: Any = value.strip()
    if v.lower() in ("true", "false"):
        v = v.lower() == "true"
    else:
        try:
            v = int(v)
        except ValueError:
            try:
                v = float(v)
            except ValueError:
                pass
    return key.strip().replace("-", "_"), v


def _duration(text: str) -> float:
    from tessera.server.config import parse_duration

    try:
        seconds = parse_duration(text)
    except TesseraError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds is None or seconds <= 0:
        raise argparse.ArgumentTypeError(f"--time-budget must be positive, not {text!r}")
    return seconds


def _slo(text: str) -> SLOSpec:
    try:
        return SLOSpec.parse(text)
    except TesseraError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "tune", help="find the engine settings that hold the most load under an SLO",
        description="Start a server per trial with settings optuna picks (profile fields, speculation, KV dtype, "
                    "replicas x threads), find each one's capacity under the SLO with the capacity search, stop "
                    "trials that cannot beat the best, and write the winner as a `tessera serve --config` TOML.")
    p.add_argument("model", help="registry name, .gguf path or model folder (as for `tessera serve`)")
    p.add_argument("--workload", required=True, metavar="TRACE|random|chat|code-edit",
                   help="a --record-traffic trace (or Azure trace CSV) to tune for, or a synthetic mix: random "
                        "lengths, multi-turn chat behind shared system prompts, or code edits")
    p.add_argument("--slo", type=_slo, default=SLOSpec.parse("ttft_p95<=1s,itl_p50<=50ms"), metavar="OBJECTIVES",
                   help="latency objectives every probe must meet, e.g. 'ttft_p95<=1s,itl_p50<=50ms' "
                        "(metrics ttft, itl, tpot, e2e at p50/p90/p95/p99) (default: %(default)s)")
    p.add_argument("--time-budget", type=_duration, default=_duration("30m"), metavar="DURATION",
                   help="wall-clock time for the whole search, e.g. 30m; no trial starts that cannot finish "
                        "(default: 30m)")
    p.add_argument("--trials", type=options.positive_int, default=100, help="most trials (default: %(default)s)")
    p.add_argument("--startup-trials", type=options.positive_int, default=4,
                   help="random trials before TPE models the results (default: %(default)s)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="do not run the default profile first")
    p.add_argument("--output-dir", type=Path, default=Path("tune"),
                   help="where the TOML, report, plots and each trial's config and log go (default: ./tune)")
    p.add_argument("--cores", type=options.positive_int, default=None,
                   help="cores replicas x threads share (default: all of this machine's)")
    p.add_argument("--set", dest="fixed", type=_fixed_option, action="append", default=[], metavar="KEY=VALUE",
                   help="an engine option every trial keeps, e.g. kv_cache_memory=1GiB (written to the TOML)")
    p.add_argument("--serve-args", default="", metavar="ARGS",
                   help="more `tessera serve` flags for every trial server, e.g. '--max-num-queued-requests 512'")
    g = p.add_argument_group("workload")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts, arrivals and the sampler (default: 0)")
    g.add_argument("--prompt-words", type=options.int_range, default=(50, 400), metavar="MIN:MAX",
                   help="random: prompt length in words (default: 50:400)")
    g.add_argument("--max-tokens", type=options.int_range, default=(16, 256), metavar="MIN:MAX",
                   help="synthetic workloads: output length per request (default: 16:256)")
    g.add_argument("--turns", type=options.positive_int, default=3, help="chat: turns per conversation (default: 3)")
    g.add_argument("--skip-invalid", action="store_true", help="TRACE: leave out invalid lines instead of refusing")
    g = p.add_argument_group("capacity search per trial")
    g.add_argument("--start-rate", type=options.positive_float, default=0.5,
                   help="first rate of the first trial, req/s; later trials start at the best so far "
                        "(default: %(default)s)")
    g.add_argument("--growth", type=options.positive_float, default=1.5, help="rate factor (default: %(default)s)")
    g.add_argument("--rel-tol", type=options.positive_float, default=0.1,
                   help="bisect until (fail - pass)/pass is below this (default: %(default)s)")
    g.add_argument("--max-probes", type=options.positive_int, default=6, help="most probes a trial (default: 6)")
    g.add_argument("--min-rate", type=options.positive_float, default=0.05, help="lowest rate (default: 0.05)")
    g.add_argument("--max-rate", type=options.positive_float, default=1000.0, help="highest rate (default: 1000)")
    g.add_argument("--probe-duration", type=options.positive_float, default=20.0,
                   help="seconds of arrivals per probe: rate x duration sessions (a chat conversation is "
                        "--turns requests) (default: %(default)s)")
    g.add_argument("--min-requests", type=options.positive_int, default=12, help="fewest requests a probe (default: 12)")
    g.add_argument("--max-requests", type=options.positive_int, default=200, help="most requests a probe (default: 200)")
    g.add_argument("--request-timeout", type=options.positive_float, default=600.0,
                   help="seconds before one request counts as failed (default: %(default)s)")
    g.add_argument("--keep-requests", action="store_true", help="keep every request's numbers in the report")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    import shlex

    from tessera.server.config import ServingSpec

    console = make_console()
    args.fixed = dict(args.fixed)
    args.serve_args = shlex.split(args.serve_args)
    slo: SLOSpec = args.slo
    workload = (synthetic_workload(args.workload, args) if args.workload in SYNTHETIC
                else trace_workload(Path(args.workload), args))
    if args.workload not in SYNTHETIC and not Path(args.workload).exists():
        raise TesseraError(f"--workload: no trace {args.workload} (or use random, chat, code-edit)")
    tuner = Tuner(args, workload, slo, console)
    # Every trial's file must be one `tessera serve --config` takes: check the first before any start.
    first = tuner.trial_toml(0, baseline_params(tuner.space))
    ServingSpec.from_args(serve_parser().parse_args(["--config", str(first)]))
    console.print(f"tuning {args.model} for {workload.name} under {slo} within {args.time_budget / 60:.0f} min "
                  f"({tuner.cores} cores: {', '.join(tuner.space.topology)})")
    started = time.monotonic()
    results = tuner.tune()
    elapsed = time.monotonic() - started
    baseline = results[0] if args.baseline and results and results[0].number == 0 else None
    console.print(trials_table(results, baseline))
    best = tuner.best()
    report = {"kind": "tessera-tune", "version": 1, "model": args.model, "workload": workload.name,
              "slo": str(slo), "time_budget_s": args.time_budget, "elapsed_s": elapsed,
              "machine": machine_info("tessera"), "cores": tuner.cores,
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "baseline": None if baseline is None else {"trial": 0, "capacity": baseline.capacity},
              "best": None if best is None else {"trial": best.number, "capacity": best.capacity,
                                                 "params": best.params},
              "trials": [vars(r) | {"bracket": list(r.bracket)} for r in results]}
    out = Path(args.output_dir)
    (out / "tune_report.json").write_text(json.dumps(report, indent=1) + "\n")
    title = f"{args.model}, {workload.name}, {slo}"
    for path in plot_tuning(results, slo, out / "tune", title):
        console.print(f"plot: {path}")
    console.print(f"report: {out / 'tune_report.json'}")
    if best is None:
        console.print("[red]no trial met the SLO at any rate tried[/]; loosen --slo or lower --min-rate")
        return 1
    engine, replicas = engine_settings(best.params, tuner.cores)
    base_cap = baseline.capacity if baseline is not None else None
    gain = f", {best.capacity / base_cap:.2f}x the default profile's {base_cap:.3g} req/s" if base_cap else ""
    comment = (f"Tuned by `tessera tune` {report['created']} on {report['machine'].get('cpu_model', 'this machine')}\n"
               f"workload {workload.name}, SLO {slo}: capacity {best.capacity:.3g} req/s (trial {best.number}){gain}.\n"
               f"Serve with: tessera serve --config {out / 'tuned.toml'}")
    (out / "tuned.toml").write_text(config_toml(args.model, {**args.fixed, **engine}, replicas, slo, comment))
    console.print(f"best: trial {best.number}, [bold]{best.capacity:.3g} req/s[/]{gain}; "
                  f"settings: {out / 'tuned.toml'} (tessera serve --config {out / 'tuned.toml'})")
    return 0
