"""Resident memory of a whole server while it serves, Tessera against llama.cpp server, same KV budget.

Each server is started in turn on the same model with a KV cache of the same number of tokens
(Tessera `--kv-cache-memory` of that many tokens at the cache's bytes per token; llama.cpp `-c`
that many tokens, its default f16 cache), then `tessera bench serve` sends a code-edit load (so
prefill work buffers, the packed or dequantized weights a step uses and the KV cache are all
touched), while the server's process tree (Tessera's front-end and engine core; llama.cpp's one
process) is sampled every 0.2 s: the sum of VmRSS, and the sum of Pss (a page mapped by two of the
processes, such as the model file, counted once). The peaks during the load are the figures.

`--defaults` starts each server with its own defaults instead (Tessera's KV cache for
`max_num_seqs` x `max_model_len`, llama.cpp's context), sends `--requests` one at a time, and
records the tree's RSS after them as well: what a user sees who starts either and uses it.

    python benchmarks/memory.py --model qwen2.5-coder-1.5b --out benchmarks/results/memory/qwen1.5b.json
    python benchmarks/memory.py --defaults --out benchmarks/results/memory/qwen1.5b_defaults.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tessera.bench.client import stop_server, wait_for_health
from tessera.hostinfo import cpu_model_name, process_tree, tree_proportional_bytes, tree_resident_bytes

LLAMA_SERVER = Path(os.environ.get("PEERS_DIR", "/work/peers")) / "llama.cpp/build/bin/llama-server"


def kv_bytes_per_token(model: str) -> int:
    """Bytes a token of KV cache takes in bfloat16/float16 (both 2 bytes): layers x 2 x kv_heads x head_dim x 2."""
    from tessera.models import registry
    from tessera.models.gguf_file import read_gguf
    from tessera.models.gguf_loader import config_from_gguf

    cfg = config_from_gguf(read_gguf(registry.ensure_model(model, progress=False)))
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2


def server_command(server: str, model: str, gguf: str, port: int, kv_tokens: int, kv_token_bytes: int,
                   slots: int, threads: int, defaults: bool = False) -> list[str]:
    if defaults and server == "tessera":
        return [sys.executable, "-m", "tessera", "serve", model, "--port", str(port), "--no-ui"]
    if defaults and server == "llamacpp":
        return [str(LLAMA_SERVER), "-m", gguf, "--alias", model, "--port", str(port)]
    if server == "tessera":
        kv_mib = kv_tokens * kv_token_bytes / 2**20
        return [sys.executable, "-m", "tessera", "serve", model, "--port", str(port), "--no-ui",
                "--disable-log-stats", "--log-level", "warning", "--num-threads", str(threads),
                "--max-num-seqs", str(slots), "--max-model-len", str(kv_tokens // slots),
                "--kv-cache-memory", f"{kv_mib:.1f}MiB"]
    if server == "llamacpp":
        if not LLAMA_SERVER.exists():
            sys.exit(f"no {LLAMA_SERVER}: run benchmarks/peers/setup_peers.sh llama")
        return [str(LLAMA_SERVER), "-m", gguf, "--alias", model, "--port", str(port), "-np", str(slots),
                "-c", str(kv_tokens), "-t", str(threads), "-tb", str(threads)]
    raise SystemExit(f"unknown server {server} (tessera, llamacpp)")


def measure(server: str, args: argparse.Namespace, gguf: str, kv_token_bytes: int) -> dict:
    port = args.port
    log = args.out.with_name(f"{args.out.stem}_{server}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(server_command(server, args.model, gguf, port, args.kv_tokens, kv_token_bytes,
                                               args.slots, args.threads, args.defaults),
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", proc, str(log))
        idle = {"rss": tree_resident_bytes(proc.pid), "pss": tree_proportional_bytes(proc.pid)}
        peak = dict(idle)
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak["rss"] = max(peak["rss"], tree_resident_bytes(proc.pid))
                peak["pss"] = max(peak["pss"], tree_proportional_bytes(proc.pid))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        bench = [sys.executable, "-m", "tessera", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                 "--model", args.model, "--dataset", "code-edit",
                 "--concurrency", str(1 if args.defaults else args.slots),
                 "--num-prompts", str(args.requests), "--max-tokens", "32:64", "--warmup", "0", "--no-progress",
                 "--output", os.devnull]
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        stop.set()
        sampler.join()
        time.sleep(1.0)
        return {"processes": len(process_tree(proc.pid)), "idle_rss": idle["rss"], "idle_pss": idle["pss"],
                "peak_rss": peak["rss"], "peak_pss": peak["pss"], "after_rss": tree_resident_bytes(proc.pid),
                "after_pss": tree_proportional_bytes(proc.pid)}
    finally:
        stop_server(proc, 60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--servers", default="tessera,llamacpp")
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV cache size in tokens, for every server")
    p.add_argument("--slots", type=int, default=4, help="concurrent sequences (and requests in flight)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--defaults", action="store_true",
                   help="each server with its own defaults (KV size, threads), requests one at a time")
    p.add_argument("--port", type=int, default=8741)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from tessera.models import registry

    gguf = str(registry.ensure_model(args.model, progress=False))
    results = {"host": cpu_model_name(), "model": args.model, "defaults": args.defaults,
               "kv_tokens": None if args.defaults else args.kv_tokens,
               "kv_bytes_per_token": kv_bytes_per_token(args.model), "slots": args.slots,
               "date": time.strftime("%Y-%m-%d %H:%M"), "servers": {}}
    for server in args.servers.split(","):
        results["servers"][server] = measure(server, args, gguf, results["kv_bytes_per_token"])
        print(server, {k: (f"{v / 2**20:.0f} MiB" if "rss" in k or "pss" in k else v)
                       for k, v in results["servers"][server].items()}, flush=True)
    servers = results["servers"]
    if "tessera" in servers and "llamacpp" in servers:
        for key in ("peak_rss", "peak_pss", "after_rss", "after_pss"):
            results[f"ratio_{key}"] = servers["tessera"][key] / servers["llamacpp"][key]
        print(f"Tessera / llama.cpp: peak RSS {results['ratio_peak_rss']:.2f}x, "
              f"peak PSS {results['ratio_peak_pss']:.2f}x, RSS after {args.requests} requests "
              f"{results['ratio_after_rss']:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
