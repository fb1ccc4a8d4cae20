"""Prefix-aware routing against round-robin on a two-node Ray cluster, side by side.

    flock /tmp/tessera-bench.lock .venv/bin/python benchmarks/ray_router.py \
        --out benchmarks/results/ray_router

Starts a local Ray cluster of two nodes (a head and a worker, one CPU each: Ray places one
replica per node), then, for each round and each policy in turn (round-robin, prefix-aware,
then the reverse order in the next round, so drift hits both alike): `tessera serve --ray
--replicas 2 --router-policy P`, the shared-prefix workload (several long documents, each
asked many questions; the documents' KV does not all fit in one replica's cache, as with a
real document set) through `tessera bench serve`, and the replicas' prefix-cache counters
from /v1/engine/stats before and after. Hit rate = prompt tokens found in a replica's cache /
prompt tokens looked up, over all replicas. Writes one bench JSON per run, the server logs
and summary.json (medians per policy, the ratio of hit rates and of TTFT p50).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tessera.bench.client import launch_server, stop_server
from tessera.bench.machine import machine_info

POLICIES = ("round-robin", "prefix-aware")


def prefix_counters(url: str) -> tuple[int, int]:
    s = httpx.get(f"{url}/v1/engine/stats", timeout=30).json()["scheduler"]
    return s["prefix_cache_hits"], s["prefix_cache_queries"]


def one_run(args, policy: str, rnd: int, address: str) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    tag = f"{policy}_r{rnd}"
    proc = launch_server(args.model, args.port, args.out / f"server_{tag}.log", "--ray", "--ray-address", address,
                         "--replicas", "2", "--router-policy", policy, "--kv-cache-memory", args.kv_cache_memory,
                         "--max-model-len", "2048", "--disable-log-stats")
    try:
        hits0, queries0 = prefix_counters(url)
        bench = args.out / f"{tag}.json"
        subprocess.run([sys.executable, "-m", "tessera", "bench", "serve", "--base-url", url, "--model", args.model,
                        "--label", policy, "--dataset", "shared-prefix", "--num-prefixes", str(args.num_prefixes),
                        "--prefix-words", str(args.prefix_words), "--max-tokens", "16:32",
                        "--concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts),
                        "--seed", str(rnd), "--warmup", "0", "--no-progress", "--output", str(bench)], check=True)
        hits1, queries1 = prefix_counters(url)
        replicas = httpx.get(f"{url}/v1/engine/stats", timeout=30).json()["engine_core"]["replicas"]
    finally:
        stop_server(proc)
    summary = json.loads(bench.read_text())["runs"][0]["summary"]
    return {"policy": policy, "round": rnd, "hit_rate": (hits1 - hits0) / max(1, queries1 - queries0),
            "prefix_hits_tokens": hits1 - hits0, "prefix_queries_tokens": queries1 - queries0,
            "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p95_s": summary["ttft_s"]["p95"],
            "output_tokens_per_s": summary["output_tokens_per_s"], "failed": summary["failed"],
            "routed": [r["routed"] for r in replicas], "nodes": [r["node_id"] for r in replicas]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=72)
    p.add_argument("--num-prefixes", type=int, default=9, help="documents (odd: round-robin cannot pin them by luck)")
    p.add_argument("--prefix-words", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--kv-cache-memory", default="64MiB", help="per replica: about five documents' KV")
    p.add_argument("--port", type=int, default=8119)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    runs = []
    try:
        for rnd in range(1, args.rounds + 1):
            order = POLICIES if rnd % 2 else POLICIES[::-1]
            for policy in order:
                t0 = time.monotonic()
                runs.append(one_run(args, policy, rnd, cluster.address))
                print(json.dumps(runs[-1]), f"({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        cluster.shutdown()
    med = {pol: {k: statistics.median(r[k] for r in runs if r["policy"] == pol)
                 for k in ("hit_rate", "ttft_p50_s", "ttft_p95_s", "output_tokens_per_s")} for pol in POLICIES}
    result = {"kind": "ray_router", "machine": machine_info(), "model": args.model,
              "settings": {k: v for k, v in vars(args).items() if k not in ("out",)}, "runs": runs, "median": med,
              # None: round-robin found nothing in its caches (each replica cycles through every document)
              "hit_rate_ratio": (med["prefix-aware"]["hit_rate"] / med["round-robin"]["hit_rate"]
                                 if med["round-robin"]["hit_rate"] > 0 else None),
              "ttft_p50_ratio": med["round-robin"]["ttft_p50_s"] / med["prefix-aware"]["ttft_p50_s"]}
    result["settings"]["out"] = str(args.out)
    (args.out / "summary.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("median", "hit_rate_ratio", "ttft_p50_ratio")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
