"""Start-up time and shared memory with the packed-weight cache.

    flock /tmp/tessera-bench.lock python benchmarks/weight_cache.py --out benchmarks/results/weight_cache.json

For each model: `tessera serve` with --no-weight-cache (packs from the GGUF), then with the cache
empty (packs and writes the cache), then twice more (maps it); start-up = process start to
/health 200. Then two servers of the model at once, mapped, each after one request (which pages
the weights in): their resident and proportional (PSS) memory from /proc/<pid>/smaps_rollup, and
how much of it is shared. Each server gets a
small KV cache (--kv-cache-memory 256MiB) so weights dominate.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tessera.bench.client import launch_server, stop_server as stop
from tessera.bench.machine import machine_info
from tessera.models.registry import tessera_home


def rollup(pid: int) -> dict[str, int]:
    """smaps_rollup fields in bytes (Rss, Pss, Shared_Clean, Private_Clean, ...)."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value, *_ = line.split()
        out[key.rstrip(":")] = int(value) * 1024
    return out


def start(model: str, port: int, extra: list[str], log: Path) -> tuple[subprocess.Popen, float]:
    """A server and its start-up time (launch to /health 200)."""
    t0 = time.monotonic()
    proc = launch_server(model, port, log, "--kv-cache-memory", "256MiB", *extra)
    return proc, time.monotonic() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b,gemma3-270m")
    p.add_argument("--port", type=int, default=8118)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    logs = args.out.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    results = []
    for model in args.models.split(","):
        row: dict = {"model": model}
        proc, row["start_s_no_cache"] = start(model, args.port, ["--no-weight-cache"], logs / f"{model}-nocache.log")
        stop(proc)
        shutil.rmtree(tessera_home() / "packed", ignore_errors=True)
        proc, row["start_s_writing_cache"] = start(model, args.port, [], logs / f"{model}-write.log")
        stop(proc)
        row["start_s_mapped"] = []
        for i in range(2):
            proc, seconds = start(model, args.port, [], logs / f"{model}-mapped{i}.log")
            row["start_s_mapped"].append(seconds)
            stop(proc)
        a, _ = start(model, args.port, [], logs / f"{model}-a.log")
        b, _ = start(model, args.port + 1, [], logs / f"{model}-b.log")
        try:
            for port in (args.port, args.port + 1):  # a first request pages the weights in
                httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300,
                           json={"prompt": "Hello, my name is", "max_tokens": 8}).raise_for_status()
            ra, rb = rollup(a.pid), rollup(b.pid)
        finally:
            stop(a)
            stop(b)
        row["two_servers"] = {"rss_mib": [ra["Rss"] / 2**20, rb["Rss"] / 2**20],
                              "pss_mib": [ra["Pss"] / 2**20, rb["Pss"] / 2**20],
                              "shared_mib": [(ra["Shared_Clean"] + ra["Shared_Dirty"]) / 2**20,
                                             (rb["Shared_Clean"] + rb["Shared_Dirty"]) / 2**20]}
        row["cache_file_mib"] = sum(f.stat().st_size for f in (tessera_home() / "packed").glob("*.pt")) / 2**20
        print(json.dumps(row))
        results.append(row)
    args.out.write_text(json.dumps({"kind": "weight_cache", "machine": machine_info(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
