"""Slow clients against a real server: a normal client's TTFT alone, then beside N sockets that each
send a request head one byte per second (slowloris), kept at N open (a closed one is reopened) for
the whole measurement.

    python benchmarks/slowloris.py                      # starts `tessera serve smollm2-135m`, 500 sockets
    python benchmarks/slowloris.py --serve-args "--timeout-header 30"
    python benchmarks/slowloris.py --url http://127.0.0.1:8000 --model NAME

Loopback only, bounded in count (at most 1,000 sockets) and time (--seconds, at most 300). Reports
the normal client's TTFT p50/p95 alone (before and after) and under the slow sockets, its non-2xx
answers, and how the slow sockets ended (closed by the server's header timeout with a 408, and
after how long).
Writes JSON to --output (default benchmarks/results/slowloris.json).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

MAX_SOCKETS, MAX_SECONDS = 1000, 300


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


async def stream_once(http: httpx.AsyncClient, model: str, max_tokens: int) -> tuple[int, float]:
    """(status, seconds to the first content token) of one streamed chat completion."""
    body = {"model": model, "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.monotonic()
    ttft = float("nan")
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, ttft
        async for line in r.aiter_lines():
            if math.isnan(ttft) and line.startswith("data: {") and '"content"' in line:
                ttft = time.monotonic() - start
    return 200, ttft


async def normal_client(url: str, model: str, requests: int, max_tokens: int) -> dict:
    """`requests` streamed requests one after another, each on a new connection."""
    statuses: dict[int, int] = {}
    ttfts: list[float] = []
    for _ in range(requests):
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            status, ttft = await stream_once(http, model, max_tokens)
            statuses[status] = statuses.get(status, 0) + 1
            if status == 200:
                ttfts.append(ttft)
    return {"requests": sum(statuses.values()), "statuses": statuses, "ttft_p50_s": pct(ttfts, 0.5),
            "ttft_p95_s": pct(ttfts, 0.95), "ttfts": ttfts}


class Slowloris:
    """`n` sockets each writing one byte of an endless request head per `interval` seconds."""

    def __init__(self, host: str, port: int, n: int, interval: float = 1.0) -> None:
        self.host, self.port, self.n, self.interval = host, port, n, interval
        self.opened = 0
        self.closed_by_server: list[float] = []  # seconds each lived
        self.answers: dict[str, int] = {}
        self.refused = 0

    async def run(self, seconds: float, stop: asyncio.Event) -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(self._slot(deadline, stop) for _ in range(self.n)))

    async def _slot(self, deadline: float, stop: asyncio.Event) -> None:
        while time.monotonic() < deadline and not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                self.refused += 1
                await asyncio.sleep(self.interval)
                continue
            self.opened += 1
            start = time.monotonic()
            head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"X-a: " + b"b" * 100_000
            try:
                for i in range(len(head)):
                    if time.monotonic() >= deadline or stop.is_set():
                        return
                    writer.write(head[i:i + 1])
                    await writer.drain()
                    try:
                        answer = await asyncio.wait_for(reader.read(64), self.interval)
                    except asyncio.TimeoutError:
                        continue
                    self.closed_by_server.append(time.monotonic() - start)
                    first = answer.split(b"\r\n", 1)[0].decode("latin-1") or "(closed without an answer)"
                    self.answers[first] = self.answers.get(first, 0) + 1
                    break
            except OSError:
                self.closed_by_server.append(time.monotonic() - start)
                self.answers["(reset)"] = self.answers.get("(reset)", 0) + 1
            finally:
                writer.close()


async def measure(url: str, model: str, sockets: int, seconds: float, requests: int, max_tokens: int) -> dict:
    """Baseline, then under the slow sockets (kept open until the client is done, at most
    `seconds`), then baseline again: the two baselines bracket the machine's own drift."""
    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("slowloris.py only runs against a loopback address")
    await normal_client(url, model, 2, max_tokens)  # warm-up
    before = await normal_client(url, model, requests, max_tokens)
    slow = Slowloris(parsed.hostname, parsed.port or 80, sockets)
    stop = asyncio.Event()
    attack = asyncio.create_task(slow.run(seconds, stop))
    await asyncio.sleep(3)  # every slow socket open and trickling before the client measures
    started = time.monotonic()
    loaded = await normal_client(url, model, requests, max_tokens)
    attacked_s = time.monotonic() - started
    stop.set()
    await attack
    after = await normal_client(url, model, requests, max_tokens)
    baseline_ttfts = before["ttfts"] + after["ttfts"]
    baseline = {"requests": before["requests"] + after["requests"], "ttft_p50_s": pct(baseline_ttfts, 0.5),
                "ttft_p95_s": pct(baseline_ttfts, 0.95), "before": before, "after": after}
    lived = slow.closed_by_server
    return {"sockets": sockets, "attacked_s": attacked_s, "baseline": baseline, "under_slowloris": loaded,
            "ttft_p95_ratio": loaded["ttft_p95_s"] / baseline["ttft_p95_s"],
            "non_2xx": {k: v for k, v in loaded["statuses"].items() if k != 200},
            "slow_sockets": {"opened": slow.opened, "closed_by_server": len(lived), "refused": slow.refused,
                             "answers": slow.answers,
                             "lived_s": {"min": min(lived), "median": statistics.median(lived), "max": max(lived)}
                             if lived else None}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start `tessera serve MODEL`)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sockets", type=int, default=500)
    p.add_argument("--seconds", type=float, default=120.0, help="longest the slow sockets stay (at most 300)")
    p.add_argument("--requests", type=int, default=12, help="the normal client's requests in each phase")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--port", type=int, default=8141)
    p.add_argument("--serve-args", default="", help="extra `tessera serve` flags when this script starts it")
    p.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "slowloris.json")
    args = p.parse_args()
    if not 1 <= args.sockets <= MAX_SOCKETS or not 0 < args.seconds <= MAX_SECONDS:
        raise SystemExit(f"--sockets must be 1..{MAX_SOCKETS} and --seconds 0..{MAX_SECONDS}")
    server = None
    url = args.url
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        repo = Path(__file__).resolve().parent.parent
        server = subprocess.Popen([sys.executable, "-m", "tessera", "serve", args.model, "--port", str(args.port),
                                   "--disable-log-stats", *args.serve_args.split()],
                                  env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        for _ in range(1200):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    try:
        result = asyncio.run(measure(url, args.model, args.sockets, args.seconds, args.requests, args.max_tokens))
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
    for run in (result["baseline"]["before"], result["baseline"]["after"], result["under_slowloris"]):
        run.pop("ttfts")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
