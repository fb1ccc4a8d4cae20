"""Batches in the gaps: an interactive open-loop load with and without a Batch API backlog, and
request priorities at saturation, on one `tessera serve --scheduling-policy priority`.

    flock /tmp/tessera-bench.lock python benchmarks/batch_gaps.py --out benchmarks/results/batch_gaps

1. capacity: `--capacity` (requests/s, e.g. what `tessera bench capacity` found), else the
   closed-loop throughput at --max-num-seqs concurrency on the interactive workload (an upper
   bound on the SLO capacity: the interactive load is then a larger share of the server);
2. batch alone on the idle server: --idle-lines lines, the idle batch throughput (lines/s);
3. interactive alone: Poisson arrivals at --load x capacity for --seconds;
4. the same arrivals with a batch of --batch-lines submitted first: interactive TTFT p95, ITL
   p50, 429s against step 3; the batch's lines answered during the window against what the idle
   capacity allows, (1 - --load) x the idle batch throughput; with --again, step 3 once more
   after it (a shared host drifts: the ratios are then given against both runs alone);
5. priorities at saturation, no batch: priority-0 requests at --load x capacity (the interactive
   load) and priority-10 ones at (--saturation - --load) x capacity, two Poisson streams at once:
   TTFT p95 per class.
Batch lines are classification-like chat requests (--batch-max-tokens tokens out). Writes
batch_gaps.json.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import json
import random
import sys
import time
from pathlib import Path

import openai

from tessera.bench.client import launch_server, stop_server
from tessera.bench.datasets import random_workload
from tessera.bench.machine import machine_info
from tessera.bench.runner import Target, run_closed_loop, run_open_loop


def pct(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def summary(results) -> dict:
    ok = [r for r in results if r.ok]
    return {"requests": len(results), "ok": len(ok), "refused_429": sum("HTTP 429" in r.error for r in results),
            "other_failures": sum(not r.ok and "HTTP 429" not in r.error for r in results),
            "ttft_p50": pct([r.ttft for r in ok], 0.5), "ttft_p95": pct([r.ttft for r in ok], 0.95),
            "itl_p50": pct([x for r in ok for x in r.itls], 0.5), "itl_p95": pct([x for r in ok for x in r.itls], 0.95)}


def batch_file(n: int, model: str, max_tokens: int, seed: int) -> bytes:
    rng = random.Random(seed)
    topics = ["billing", "a bug report", "a feature request", "praise", "spam", "a refund", "shipping"]
    lines = [{"custom_id": f"t{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "max_tokens": max_tokens, "temperature": 0, "messages": [
                  {"role": "system", "content": "Classify the customer message into one of: billing, bug, "
                                                "feature, praise, spam, refund, shipping. Answer with the label."},
                  {"role": "user", "content": f"Ticket {i}: a message about {rng.choice(topics)} "
                                              f"({rng.randint(1, 10**6)})."}]}} for i in range(n)]
    return ("\n".join(json.dumps(x) for x in lines) + "\n").encode()


def submit(c: openai.OpenAI, data: bytes) -> str:
    f = c.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id


def completed(c: openai.OpenAI, bid: str) -> tuple[str, int]:
    b = c.batches.retrieve(bid)
    return b.status, b.request_counts.completed + b.request_counts.failed


def idle_batch(c: openai.OpenAI, args: argparse.Namespace) -> dict:
    bid = submit(c, batch_file(args.idle_lines, args.model, args.batch_max_tokens, seed=7))
    t0 = time.monotonic()
    while completed(c, bid)[0] != "completed":
        time.sleep(0.2)
    seconds = time.monotonic() - t0
    return {"lines": args.idle_lines, "seconds": seconds, "lines_per_s": args.idle_lines / seconds}


def interactive(target: Target, args: argparse.Namespace, rate: float) -> dict:
    n = max(1, round(rate * args.seconds))
    work = random_workload(n, seed=11, input_words=(50, 200), output_tokens=(64, 64))
    run = asyncio.run(run_open_loop(target, work, rate, seed=11, progress=False, drain_timeout=120))
    return {"rate_rps": rate, "duration_s": run.duration, **summary(run.results)}


def saturation(target: Target, args: argparse.Namespace, capacity: float) -> dict:
    rates = {0: args.load * capacity, 10: (args.saturation - args.load) * capacity}

    def stream(priority: int, seed: int):
        n = max(2, round(rates[priority] * args.seconds))
        work = random_workload(n, seed=seed, input_words=(50, 200), output_tokens=(64, 64))
        work = [dataclasses.replace(s, turns=[dataclasses.replace(t, extra={"priority": priority, "ignore_eos": True})
                                              for t in s.turns]) for s in work]
        return run_open_loop(target, work, rates[priority], seed=seed, progress=False, drain_timeout=240)

    async def both():
        return await asyncio.gather(stream(0, 13), stream(10, 17))

    high, low = asyncio.run(both())
    return {"rate_rps": sum(rates.values()), "rates_rps": rates,
            "priority_0": summary(high.results), "priority_10": summary(low.results)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--port", type=int, default=8131)
    p.add_argument("--capacity", type=float, default=None, help="the SLO capacity in requests/s")
    p.add_argument("--load", type=float, default=0.5, help="interactive load, a share of the capacity")
    p.add_argument("--saturation", type=float, default=1.5, help="the priority run's load, a multiple of it")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--batch-lines", type=int, default=5000)
    p.add_argument("--idle-lines", type=int, default=200)
    p.add_argument("--batch-max-tokens", type=int, default=8)
    p.add_argument("--skip-saturation", action="store_true")
    p.add_argument("--only-saturation", action="store_true", help="step 5 alone (with --capacity)")
    p.add_argument("--again", action="store_true", help="run the interactive load alone again after the batch")
    p.add_argument("--server-flags", default="", help="more `tessera serve` flags, e.g. '--num-threads 1'")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    flags = ["--scheduling-policy", "priority", "--max-num-seqs", str(args.max_num_seqs),
             "--batch-store", str(args.out / "batches.sqlite3"), *args.server_flags.split()]
    (args.out / "batches.sqlite3").unlink(missing_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    proc = launch_server(args.model, args.port, args.out / "server.log", *flags)
    target = Target(base_url=url, model=args.model, temperature=0.0, request_timeout=300)
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2, timeout=60)
    out: dict = {"kind": "batch_gaps", "machine": machine_info(), "model": args.model,
                 "command": ["serve", args.model, *flags], "args": {k: str(v) for k, v in vars(args).items()}}
    try:
        capacity = args.capacity
        if capacity is None:
            work = random_workload(2 * args.max_num_seqs, seed=1, input_words=(50, 200), output_tokens=(64, 64))
            cap = asyncio.run(run_closed_loop(target, work, args.max_num_seqs, progress=False))
            capacity = sum(r.ok for r in cap.results) / cap.duration
            out["capacity_source"] = "closed-loop throughput (an upper bound on the SLO capacity)"
        else:
            out["capacity_source"] = "given (--capacity)"
        out["capacity_rps"] = capacity
        print(f"capacity {capacity:.3f} req/s", flush=True)
        if args.only_saturation:
            out["priority_saturation"] = saturation(target, args, capacity)
            print("saturation", out["priority_saturation"], flush=True)
            return 0
        out["idle_batch"] = idle_batch(c, args)
        print("idle batch", out["idle_batch"], flush=True)
        rate = args.load * capacity
        out["interactive_alone"] = interactive(target, args, rate)
        print("alone", out["interactive_alone"], flush=True)
        bid = submit(c, batch_file(args.batch_lines, args.model, args.batch_max_tokens, seed=9))
        time.sleep(2.0)  # the batch is running when the interactive load starts
        _, before = completed(c, bid)
        t0 = time.monotonic()
        with_batch = interactive(target, args, rate)
        window = time.monotonic() - t0
        _, after = completed(c, bid)
        c.batches.cancel(bid)
        allowed = (1 - args.load) * out["idle_batch"]["lines_per_s"]
        with_batch["batch"] = {"lines_in_window": after - before, "window_s": window,
                               "lines_per_s": (after - before) / window, "idle_capacity_allows_lines_per_s": allowed,
                               "share_of_allowed": (after - before) / window / allowed}
        out["interactive_with_batch"] = with_batch
        alone = out["interactive_alone"]
        out["ratios"] = {"ttft_p95": with_batch["ttft_p95"] / alone["ttft_p95"],
                         "itl_p50": with_batch["itl_p50"] / alone["itl_p50"],
                         "interactive_429": with_batch["refused_429"],
                         "batch_share_of_idle_capacity": with_batch["batch"]["share_of_allowed"]}
        print("with batch", with_batch, "\nratios", out["ratios"], flush=True)
        while completed(c, bid)[0] not in ("cancelled", "completed"):
            time.sleep(0.5)
        if args.again:
            after = out["interactive_alone_after"] = interactive(target, args, rate)
            out["ratios_against_after"] = {"ttft_p95": with_batch["ttft_p95"] / after["ttft_p95"],
                                           "itl_p50": with_batch["itl_p50"] / after["itl_p50"]}
            print("alone again", after, "\nratios", out["ratios_against_after"], flush=True)
        if not args.skip_saturation:
            out["priority_saturation"] = saturation(target, args, capacity)
            print("saturation", out["priority_saturation"], flush=True)
    finally:
        out["server_exit_code"] = stop_server(proc)
        (args.out / "batch_gaps.json").write_text(json.dumps(out, indent=1))
        for name in ("batches.sqlite3", "batches.sqlite3-wal", "batches.sqlite3-shm"):
            (args.out / name).unlink(missing_ok=True)  # the 5,000-line input is not a result
    return 0


if __name__ == "__main__":
    sys.exit(main())
