"""Soak: 30 minutes of mixed traffic with cancellations; resident memory and free KV blocks must
stay flat.

    flock /tmp/tessera-bench.lock python benchmarks/soak.py --out benchmarks/results/soak
    python benchmarks/soak.py --minutes 2 --out /tmp/soak     # a quick look

One `tessera serve` (default smollm2-135m). Eight client workers loop until the time is up, each
request drawn at random: completions or chat, streamed or not, 8-128 output tokens, n = 2 now and
then, a JSON-schema constraint now and then (drawn from a fixed set of SCHEMAS, as an application
has a few: every new schema adds ~2 MiB to xgrammar's compiled-grammar cache, bounded at 256 MiB),
a hostile body now and then, and about a third of streams cut by the client at a random point. Every 10 s: the server's resident memory (its engine processes included; `rss_api`: the API process alone)
(/proc/<pid>/status), the engine's free blocks and running/waiting requests (/v1/engine/stats).
After a quiet moment at the end, every block must be free. Memory trend: least-squares slope of
resident memory over the second half of the run (the first half includes allocator warm-up), in
MiB per hour, with the spread of the samples around the fit, for the whole server and for its
engine and API processes apart; "flat" when the fitted rise over the second half is at most twice
that spread or 0.5 % of the process's median size. Writes soak.json and soak.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from tessera.bench.client import launch_server, stop_server
from tessera.hostinfo import resident_bytes
from tessera.hostinfo import tree_resident_bytes as process_rss
from tessera.bench.datasets import VOCABULARY, random_json_schema
from tessera.bench.hostile import hostile_cases
from tessera.bench.machine import machine_info

SAMPLE_S = 10.0
SCHEMAS = [random_json_schema(random.Random(1000 + i))[0] for i in range(16)]


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(5, 300)))


async def worker(client: httpx.AsyncClient, model: str, rng: random.Random, until: float, counts: dict,
                 hostile_share: float = 0.05) -> None:
    hostile = [c for c in hostile_cases(model) if len(c.body) < 2**20]
    while time.monotonic() < until:
        kind = rng.random()
        stream = rng.random() < 0.6
        chat = rng.random() < 0.5
        body: dict = {"model": model, "max_tokens": rng.randint(8, 128), "temperature": rng.choice([0.0, 0.8]),
                      "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": _prompt(rng)}]
        else:
            body["prompt"] = _prompt(rng)
        if kind < hostile_share:
            case = rng.choice(hostile)
            r = await client.request(case.method, case.path, content=case.body,
                                     headers={"content-type": case.content_type})
            counts["hostile"] += 1
            counts["5xx"] += r.status_code >= 500
            continue
        if kind < 0.15:
            body["n"] = 2
        elif kind < 0.25 and chat:
            schema = rng.choice(SCHEMAS)
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        cut = rng.random() < 0.35 and stream
        try:
            if stream:
                async with client.stream("POST", path, json=body) as r:
                    counts["5xx"] += r.status_code >= 500
                    stop_after = rng.randint(1, 40) if cut else 10**9
                    chunks = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunks += 1
                            if chunks >= stop_after:
                                counts["cancelled"] += 1
                                break
            else:
                r = await client.post(path, json=body)
                counts["5xx"] += r.status_code >= 500
            counts["requests"] += 1
        except httpx.HTTPError:
            counts["transport_errors"] += 1


async def sampler(url: str, pid: int, t0: float, until: float, samples: list) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while time.monotonic() < until:
            stats = (await client.get("/v1/engine/stats")).json()["scheduler"]
            tree, api = process_rss(pid), resident_bytes(pid)
            samples.append({"t": time.monotonic() - t0, "rss": tree, "rss_api": api, "rss_engine": tree - api,
                            "free_blocks": stats["num_blocks_free"],
                            "total_blocks": stats["num_blocks_total"], "running": stats["num_running"],
                            "waiting": stats["num_waiting"]})
            await asyncio.sleep(SAMPLE_S)


def slope_mib_per_hour(samples: list, key: str = "rss") -> tuple[float, float]:
    """Least-squares slope of `key` (bytes) over time (MiB/h) and the residuals' standard deviation (MiB)."""
    xs = [s["t"] for s in samples]
    ys = [s[key] / 2**20 for s in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    resid = [y - (my + slope * (x - mx)) for x, y in zip(xs, ys)]
    return slope * 3600, statistics.pstdev(resid)


def plot(samples: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] / 60 for s in samples]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a.plot(t, [s["rss"] / 2**20 for s in samples], label="server (all processes)")
    a.plot(t, [s["rss_engine"] / 2**20 for s in samples], label="engine process")
    a.plot(t, [s["rss_api"] / 2**20 for s in samples], label="API process")
    a.set_ylabel("resident memory (MiB)")
    a.legend(loc="center right")
    a.set_title("Soak: mixed traffic with cancellations")
    b.plot(t, [s["free_blocks"] for s in samples], label="free KV blocks")
    b.plot(t, [s["running"] for s in samples], label="running")
    b.plot(t, [s["waiting"] for s in samples], label="waiting")
    b.axhline(samples[0]["total_blocks"], color="gray", linestyle=":", label="total blocks")
    b.set_xlabel("minutes")
    b.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


async def soak(url: str, pid: int, args) -> tuple[list, dict]:
    rng = random.Random(args.seed)
    counts = {"requests": 0, "cancelled": 0, "hostile": 0, "5xx": 0, "transport_errors": 0}
    samples: list = []
    t0 = time.monotonic()
    until = t0 + args.minutes * 60
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=32)) as client:
        await asyncio.gather(sampler(url, pid, t0, until, samples),
                             *(worker(client, args.model, random.Random(rng.random()), until, counts,
                                      args.hostile_share) for _ in range(args.workers)))
    return samples, counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--port", type=int, default=8115)
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--hostile-share", type=float, default=0.05,
                   help="share of requests drawn from the hostile corpus (bodies under 1 MiB); 0 isolates "
                        "what normal traffic does to memory")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    proc = launch_server(args.model, args.port, args.out / "server.log")
    try:
        samples, counts = asyncio.run(soak(url, proc.pid, args))
        time.sleep(3)  # let the last aborts land
        final = httpx.get(f"{url}/v1/engine/stats", timeout=10).json()["scheduler"]
    finally:
        exit_code = stop_server(proc)
    half = [s for s in samples if s["t"] >= samples[-1]["t"] / 2]
    if len(half) < 3:  # a very short run: fit over all samples
        half = samples
    span_h = (half[-1]["t"] - half[0]["t"]) / 3600
    trends = {}
    for key in ("rss", "rss_engine", "rss_api"):
        slope, spread = slope_mib_per_hour(half, key)
        values = [s[key] / 2**20 for s in half]
        trends[key] = {"slope_mib_per_hour": slope, "residual_sd_mib": spread,
                       "change_over_second_half_mib": slope * span_h,
                       "min_mib": min(values), "max_mib": max(values), "median_mib": statistics.median(values),
                       # flat: the fitted rise over the second half is within the samples' own noise
                       # (twice their spread around the fit), or under 0.5 % of the process's size
                       "flat": slope * span_h <= max(2 * spread, 0.005 * statistics.median(values))}
    result = {
        "kind": "soak", "machine": machine_info(), "model": args.model, "minutes": args.minutes,
        "workers": args.workers, "counts": counts, "samples": samples, "trends": trends,
        "blocks_free_at_end": final["num_blocks_free"], "blocks_total": final["num_blocks_total"],
        "running_at_end": final["num_running"], "waiting_at_end": final["num_waiting"],
        "server_exit_code": exit_code,
    }
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(samples, args.out / "soak.png")
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "machine")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
