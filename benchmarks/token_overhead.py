"""What serving adds to each token at one user: the streamed inter-token latency against the
engine's own step time, and the CPU time each process spends per token.

Starts `tessera serve MODEL` (extra flags after `--`), streams `--requests` chat completions of
`--tokens` tokens one at a time through the official openai client (ignore_eos), and reads:
- ITL: the gaps between streamed chunks, median over all requests;
- step: the engine's mean step time over the same tokens (tessera:step_time_seconds from /metrics);
- CPU ms per token of the API process and of the engine-core process (/proc utime + stime).
On a host with as many cores as the engine has threads, the API process's CPU time is taken from
the engine's threads: ITL - step is what a token costs around the step.

    python benchmarks/token_overhead.py --model smollm2-135m --out benchmarks/results/token_overhead/x.json
    TESSERA_CPU_ISA=avx2 python benchmarks/token_overhead.py ...   # the same capped at AVX2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import psutil
from openai import OpenAI

from tessera.bench.client import launch_server, scrape_metric, stop_server
from tessera.bench.machine import machine_info


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def step_totals(base: str) -> tuple[float, float]:
    """(sum, count) of the step-time histogram, summed over models."""
    return (scrape_metric(base, "tessera:step_time_seconds_sum"),
            scrape_metric(base, "tessera:step_time_seconds_count"))


def stream(client: OpenAI, model: str, prompt: str, tokens: int) -> list[float]:
    """Arrival times of the content chunks of one streamed reply."""
    times = []
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--label", default="tessera")
    ap.add_argument("--out", type=Path)
    ap.add_argument("serve_args", nargs="*", help="extra `tessera serve` flags (after --)")
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    log = Path(tempfile.gettempdir()) / f"token_overhead_{args.port}.log"
    server = launch_server(args.model, args.port, log, *args.serve_args)
    try:
        api = psutil.Process(server.pid)
        cores = [c for c in api.children(recursive=True) if "python" in c.name()]
        client = OpenAI(base_url=f"{base}/v1", api_key="none")
        prompt = "Write a long story about a lighthouse keeper and the sea, in many short paragraphs."
        stream(client, args.model, prompt, 16)  # warm-up: the first request's compilation and caches
        gaps: list[float] = []
        s0, c0 = step_totals(base)
        api0, core0 = cpu_s(api), sum(cpu_s(c) for c in cores)
        t0 = time.perf_counter()
        produced = 0
        for i in range(args.requests):
            times = stream(client, args.model, f"{prompt} ({i})", args.tokens)
            gaps += [b - a for a, b in zip(times, times[1:])]
            produced += len(times)
        wall = time.perf_counter() - t0
        api1, core1 = cpu_s(api), sum(cpu_s(c) for c in cores)
        s1, c1 = step_totals(base)
    finally:
        stop_server(server)
    steps = c1 - c0
    result = {
        "label": args.label, "model": args.model, "serve_args": args.serve_args,
        "cpu_isa": os.environ.get("TESSERA_CPU_ISA", "auto"), "machine": machine_info(),
        "requests": args.requests, "tokens": produced, "wall_s": wall,
        "itl_ms_p50": statistics.median(gaps) * 1e3,
        "itl_ms_mean": statistics.fmean(gaps) * 1e3,
        "step_ms_mean": (s1 - s0) / steps * 1e3 if steps else None,
        "steps": steps,
        "api_cpu_ms_per_token": (api1 - api0) / produced * 1e3,
        "core_cpu_ms_per_token": (core1 - core0) / produced * 1e3 if cores else None,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
