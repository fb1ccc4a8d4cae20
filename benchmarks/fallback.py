"""Degradation to a smaller model under load (issue 13): a saturated model's overflow answered by its
fallback instead of 429, measured against the same load without the rule.

    flock /tmp/tessera-bench.lock python benchmarks/fallback.py --out benchmarks/results/wave3/fallback

Two servers in turn, each serving BIG and SMALL from one port (`--config`, both preloaded, each in
its own engine process). BIG is kept small on purpose (`max_num_seqs`, `max_num_queued_requests`)
so that the offered load, Poisson arrivals all asking for BIG, saturates it; each engine gets one
torch thread (two engines share 2 cores) and SMALL its own `max_queue_wait`, so it refuses what it
could not start in time rather than queueing past the SLO. Arm `no-rule`: BIG has
no fallback, its overflow is refused with 429. Arm `rule`: `fallback = SMALL`, `when =
["queue_full", "queue_wait > W"]`. Every request streams; the script records its status, who
answered (`x-tessera-model`, `x-tessera-fallback-cause`) and its time to first token. Writes
fallback.json and prints the table for benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from tessera.bench.client import launch_server, stop_server
from tessera.bench.datasets import VOCABULARY
from tessera.bench.machine import machine_info


def toml(args: argparse.Namespace, rule: bool) -> str:
    fallback = (f'fallback = "{args.small}"\nwhen = ["queue_full", "queue_wait > {args.max_wait}s"]\n'
                if rule else "")
    return (f'[[model]]\nname = "{args.big}"\nmodel = "{args.big}"\npreload = true\n{fallback}'
            f"max_num_queued_requests = {args.big_queue}\n[model.engine]\nmax_num_seqs = {args.big_seqs}\n"
            f"num_threads = {args.threads}\n\n"
            f'[[model]]\nname = "{args.small}"\nmodel = "{args.small}"\npreload = true\n'
            f"max_queue_wait = {args.small_max_wait}\n[model.engine]\nnum_threads = {args.threads}\n")


async def one(client: httpx.AsyncClient, model: str, rng: random.Random, max_tokens: int) -> dict:
    prompt = " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(50, 200)))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    rec: dict = {"status": None, "model": None, "cause": None, "ttft_s": None, "e2e_s": None}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            rec["status"] = r.status_code
            rec["model"] = r.headers.get("x-tessera-model")
            rec["cause"] = r.headers.get("x-tessera-fallback-cause")
            async for line in r.aiter_lines():
                if rec["ttft_s"] is None and line.startswith("data: {") and '"text":""' not in line:
                    rec["ttft_s"] = time.monotonic() - t0
    except httpx.HTTPError as exc:
        rec["status"] = f"transport: {type(exc).__name__}"
    rec["e2e_s"] = time.monotonic() - t0
    return rec


async def load(url: str, model: str, rate: float, duration: float, max_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    tasks = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        end = time.monotonic() + duration
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(one(client, model, random.Random(rng.random()), max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*tasks)


def pct(values: list[float], q: float):
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q / 100 * len(s)))], 3)


def summarize(records: list[dict], big: str, slo: float) -> dict:
    ok = [r for r in records if r["status"] == 200]
    degraded = [r for r in ok if r["model"] != big]
    direct = [r for r in ok if r["model"] == big]
    ttft = lambda rs: [r["ttft_s"] for r in rs if r["ttft_s"] is not None]  # noqa: E731
    return {
        "requests": len(records), "answered": len(ok), "by_big": len(direct), "by_fallback": len(degraded),
        "429": sum(r["status"] == 429 for r in records),
        "other_errors": sum(r["status"] not in (200, 429) for r in records),
        "causes": {c: sum(r["cause"] == c for r in degraded) for c in sorted({r["cause"] for r in degraded})},
        "ttft_p50_s": pct(ttft(ok), 50), "ttft_p95_s": pct(ttft(ok), 95),
        "ttft_p95_big_s": pct(ttft(direct), 95), "ttft_p95_fallback_s": pct(ttft(degraded), 95),
        "fallback_within_slo": (round(sum(t <= slo for t in ttft(degraded)) / len(ttft(degraded)), 3)
                                if ttft(degraded) else None),
        "answered_within_slo": round(sum(t <= slo for t in ttft(ok)) / len(records), 3) if records else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--big", default="qwen2.5-coder-0.5b")
    p.add_argument("--small", default="smollm2-135m")
    p.add_argument("--big-seqs", type=int, default=4)
    p.add_argument("--big-queue", type=int, default=2)
    p.add_argument("--max-wait", type=float, default=1.0, help="the rule's queue_wait bound, seconds")
    p.add_argument("--small-max-wait", type=float, default=1.0,
                   help="the fallback's own --max-queue-wait: it refuses what it could not start in time")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per engine: two engines share the machine's cores")
    p.add_argument("--rate", type=float, default=1.5, help="requests per second, all for --big")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--port", type=int, default=8119)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    results = {"machine": machine_info(), "settings": {k: v for k, v in vars(args).items() if k != "out"}}
    for arm in ("no-rule", "rule"):
        config = args.out / f"{arm}.toml"
        config.write_text(toml(args, arm == "rule"))
        proc = launch_server(args.big, args.port, args.out / f"server_{arm}.log", "--config", str(config))
        try:
            records = asyncio.run(load(url, args.big, args.rate, args.duration, args.max_tokens, args.seed))
        finally:
            stop_server(proc)
        results[arm] = {"summary": summarize(records, args.big, args.slo_ttft), "requests": records}
        print(arm, json.dumps(results[arm]["summary"]), flush=True)
    (args.out / "fallback.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
