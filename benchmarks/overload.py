"""Overload: a minute of open-loop traffic at 10x the measured capacity, then a normal load.
The server should answer 429 + Retry-After for what it cannot take, keep the
latency of what it admits, keep its memory bounded, and be back to normal as soon as the load drops.

    flock /tmp/tessera-bench.lock python benchmarks/overload.py --out benchmarks/results/overload

1. capacity: closed loop at --max-num-seqs concurrency on the random workload (fixed output
   lengths) gives the server's throughput R in requests/s;
2. overload: Poisson arrivals at 10 R for --seconds;
3. recovery: Poisson arrivals at 0.5 R for half as long, starting right after.
The server runs with `--max-queue-wait` (refuse what the step-cost model forecasts would wait longer
than that for its prompt); `--no-queue-wait-limit` shows the same run with only the queue bound.
Its resident memory is sampled every second. Writes overload.json and overload.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

from tessera.bench.client import launch_server, stop_server
from tessera.hostinfo import resident_bytes as process_rss
from tessera.bench.datasets import random_workload
from tessera.bench.machine import machine_info
from tessera.bench.runner import Target, run_closed_loop, run_open_loop


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def phase_summary(results, slo_ttft: float) -> dict:
    ok = [r for r in results if r.ok]
    refused = [r for r in results if "HTTP 429" in r.error]
    other = [r for r in results if not r.ok and "HTTP 429" not in r.error]
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itls]
    return {"requests": len(results), "admitted_ok": len(ok), "refused_429": len(refused),
            "other_failures": len(other), "other_errors": sorted({r.error[:120] for r in other})[:5],
            "share_429": len(refused) / max(1, len(results)),
            "ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95), "itl_p50": pct(itl, 0.5),
            "itl_p95": pct(itl, 0.95), "admitted_within_slo": sum(t <= slo_ttft for t in ttft) / max(1, len(ttft))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--port", type=int, default=8116)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--factor", type=float, default=10.0)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-queue-wait", type=float, default=1.0)
    p.add_argument("--no-queue-wait-limit", action="store_true")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT objective for admitted requests (s)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    flags = ["--max-num-seqs", str(args.max_num_seqs)]
    if not args.no_queue_wait_limit:
        flags += ["--max-queue-wait", str(args.max_queue_wait)]
    t0 = time.monotonic()
    proc = launch_server(args.model, args.port, args.out / "server.log", *flags)
    rss: list[tuple[float, int]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                rss.append((time.monotonic() - t0, process_rss(proc.pid)))
            except (OSError, RuntimeError):
                return
            stop.wait(1.0)

    target = Target(base_url=url, model=args.model, temperature=0.0, request_timeout=300)
    out: dict = {"kind": "overload", "machine": machine_info(), "model": args.model,
                 "command": ["serve", args.model, *flags],
                 "factor": args.factor, "seconds": args.seconds, "slo_ttft": args.slo_ttft}
    try:
        threading.Thread(target=watch, daemon=True).start()
        # 1. capacity
        cap_work = random_workload(4 * args.max_num_seqs, seed=1, input_words=(50, 200), output_tokens=(64, 64))
        cap = asyncio.run(run_closed_loop(target, cap_work, args.max_num_seqs, progress=False))
        capacity = sum(r.ok for r in cap.results) / cap.duration
        out["capacity_rps"] = capacity
        print(f"capacity: {capacity:.2f} requests/s")
        # 2. overload, then 3. recovery
        phases = {}
        for name, rate, seconds, seed in (("overload", args.factor * capacity, args.seconds, 2),
                                          ("recovery", 0.5 * capacity, args.seconds / 2, 3)):
            n = max(1, round(rate * seconds))
            work = random_workload(n, seed=seed, input_words=(50, 200), output_tokens=(64, 64))
            started = time.monotonic() - t0
            run = asyncio.run(run_open_loop(target, work, rate, seed, progress=False, drain_timeout=120))
            phases[name] = {"rate_rps": rate, "started_s": started, "duration_s": run.duration,
                            **phase_summary(run.results, args.slo_ttft),
                            "timeline": [(round(r.start - run.started + started, 3), r.ok, "HTTP 429" in r.error,
                                          round(r.ttft, 4) if r.ok else None) for r in run.results]}
            s = phases[name]
            print(f"{name}: {rate:.1f}/s, {s['requests']} requests, 429 {s['share_429']:.0%}, "
                  f"TTFT p50/p95 {s['ttft_p50']}/{s['ttft_p95']}, other failures {s['other_failures']}")
        out["phases"] = phases
    finally:
        stop.set()
        out["server_exit_code"] = stop_server(proc)
    mib = [b / 2**20 for _, b in rss]
    out["rss_mib"] = {"start": mib[0], "max": max(mib), "end": mib[-1], "samples": [(t, b / 2**20) for t, b in rss]}
    rec = out["phases"]["recovery"]["timeline"]
    first_ok = next((t for t, ok, _, ttft in rec if ok and ttft is not None and ttft <= args.slo_ttft), None)
    out["recovery_first_ok_after_s"] = None if first_ok is None else first_ok - out["phases"]["recovery"]["started_s"]
    (args.out / "overload.json").write_text(json.dumps(out, indent=1))
    plot(out, args.out / "overload.png")
    print(json.dumps({k: v for k, v in out.items() if k not in ("machine", "phases", "rss_mib")}, indent=1))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "timeline"} for k, v in out["phases"].items()},
                     indent=1))
    return 0


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for name, phase in out["phases"].items():
        tl = phase["timeline"]
        secs: dict[int, list[int]] = {}
        for t, ok, refused, _ in tl:
            s = secs.setdefault(int(t), [0, 0, 0])
            s[0 if ok else 1 if refused else 2] += 1
        xs = sorted(secs)
        a.bar(xs, [secs[x][0] for x in xs], color="tab:green", width=1.0, label="admitted, ok" if name == "overload" else None)
        a.bar(xs, [secs[x][1] for x in xs], bottom=[secs[x][0] for x in xs], color="tab:orange", width=1.0,
              label="429" if name == "overload" else None)
        a.bar(xs, [secs[x][2] for x in xs], bottom=[secs[x][0] + secs[x][1] for x in xs], color="tab:red",
              width=1.0, label="other failure" if name == "overload" else None)
        pts = [(t, ttft) for t, ok, _, ttft in tl if ok]
        b.scatter([p[0] for p in pts], [p[1] for p in pts], s=4)
    a.set_ylabel("requests started / s")
    a.legend()
    a.set_title(f"{out['model']}: {out['factor']:g}x capacity ({out['capacity_rps']:.2f} req/s), then 0.5x")
    b.axhline(out["slo_ttft"], color="gray", linestyle=":")
    b.set_ylabel("TTFT of admitted (s)")
    samples = out["rss_mib"]["samples"]
    c.plot([s[0] for s in samples], [s[1] for s in samples])
    c.set_ylabel("server RSS (MiB)")
    c.set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
