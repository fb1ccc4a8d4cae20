"""`tessera bench cancel-storm`: many streams cut by their clients at random points.

A client that goes away must cost the server nothing afterwards: its request leaves the
scheduler and its KV blocks come back at once. The storm sends N streaming requests (48 at a
time by default), each with a plan: cut before the response starts, after the first chunk,
mid-output, or read to the end. Afterwards the server is polled until idle and the report says
whether every KV block is free, nothing is running or waiting, and what /metrics counted.

    tessera bench cancel-storm --base-url http://127.0.0.1:8000 --model smollm2-135m --requests 1000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
import httpx

from tessera.bench.client import scrape_metric
from tessera.bench.datasets import VOCABULARY
from tessera.errors import TesseraError

PLANS = ("before", "first", "mid", "mid", "full")


@dataclass
class StormReport:
    requests: int
    cut_before_response: int
    cut_after_output: int
    completed: int
    errors: int  # 5xx or transport errors (429s from a full queue are counted apart)
    refused_429: int
    seconds: float
    blocks_free: int
    blocks_total: int
    running_after: int
    waiting_after: int
    aborts_counted: float  # tessera:request_aborts_total during the storm (None-safe 0 elsewhere)
    error_samples: list[str]  # the first few distinct errors, to tell a server fault from a client one

    @property
    def leaked_blocks(self) -> int:
        return self.blocks_total - self.blocks_free


async def _storm(url: str, model: str, n: int, concurrency: int, seed: int,
                 max_tokens: int) -> tuple[dict, list[str]]:
    rng = random.Random(seed)
    counts = {"before": 0, "after": 0, "completed": 0, "errors": 0, "429": 0}
    samples: list[str] = []

    def error(what: str) -> None:
        counts["errors"] += 1
        if what not in samples and len(samples) < 5:
            samples.append(what)

    async def one(client: httpx.AsyncClient, plan: str, sem: asyncio.Semaphore) -> None:
        body = {"model": model, "prompt": " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(5, 300))),
                "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 1.0}
        async with sem:
            try:
                if plan == "before":
                    try:
                        await asyncio.wait_for(client.post("/v1/completions", json=body), timeout=rng.random() * 0.02)
                    except asyncio.TimeoutError:
                        pass
                    counts["before"] += 1
                    return
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code == 429:
                        counts["429"] += 1
                        return
                    if r.status_code >= 500:
                        error(f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}")
                        return
                    chunks = 0
                    stop_at = {"first": 1, "mid": rng.randint(2, max(2, max_tokens // 2)), "full": 10**9}[plan]
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunks += 1
                            if chunks >= stop_at:
                                counts["after"] += 1
                                return  # leaving the block closes the connection mid-stream
                    counts["completed"] += 1
            except httpx.HTTPError as exc:
                error(f"{type(exc).__name__} ({plan}): {exc}"[:300])

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 limits=httpx.Limits(max_connections=concurrency + 16)) as client:
        await asyncio.gather(*(one(client, rng.choice(PLANS), sem) for _ in range(n)))
    return counts, samples


def run_cancel_storm(url: str, model: str, n: int = 1000, concurrency: int = 48, seed: int = 14,
                     max_tokens: int = 64, idle_timeout: float = 60.0) -> StormReport:
    url = url.rstrip("/").removesuffix("/v1")
    aborts_before = scrape_metric(url, "tessera:request_aborts_total") if _has_metrics(url) else 0.0
    t0 = time.monotonic()
    counts, samples = asyncio.run(_storm(url, model, n, concurrency, seed, max_tokens))
    seconds = time.monotonic() - t0
    deadline = time.monotonic() + idle_timeout
    while True:  # the last aborts land within a step or two
        s = httpx.get(f"{url}/v1/engine/stats", timeout=10).json()["scheduler"]
        idle = s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_blocks_free"] == s["num_blocks_total"]
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    aborts = (scrape_metric(url, "tessera:request_aborts_total") - aborts_before) if _has_metrics(url) else 0.0
    return StormReport(n, counts["before"], counts["after"], counts["completed"], counts["errors"], counts["429"],
                       seconds, s["num_blocks_free"], s["num_blocks_total"], s["num_running"], s["num_waiting"],
                       aborts, samples)


def _has_metrics(url: str) -> bool:
    return httpx.get(f"{url}/metrics", timeout=10).status_code == 200


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cancel-storm", help="many streams cut by their clients; check no KV block leaks",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="a Tessera server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="a model the server serves")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--output", type=Path, default=None, help="write the report as JSON here")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        report = run_cancel_storm(args.base_url, args.model, args.requests, args.concurrency, args.seed,
                                  args.max_tokens)
    except httpx.HTTPError as exc:
        raise TesseraError(f"cannot reach {args.base_url}: {exc}") from None
    data = {**asdict(report), "leaked_blocks": report.leaked_blocks}
    print(json.dumps(data, indent=1))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"kind": "cancel-storm", "base_url": args.base_url, **data}, indent=1))
    bad = report.leaked_blocks or report.running_after or report.waiting_after or report.errors
    return 1 if bad else 0

