"""The disk tier of the prefix cache on multi-turn chat: TTFT of later turns with and without it.

    flock /tmp/tessera-bench.lock python benchmarks/kv_offload.py \\
        --out benchmarks/results/kv_offload

A RAM KV budget far below what the conversations hold (--kv-cache-memory), so a conversation's
history is evicted between its turns when other conversations' turns come in between
(--max-active-conversations: the conversations take turns, as users who read and type do). Three servers, one after the other, same seeded workload:
  none     no disk tier: a later turn recomputes the conversation whose blocks were evicted;
  tier     --kv-offload-dir on an empty folder: evicted blocks are loaded back;
  restart  a fresh server on the folder `tier` filled: even first turns (the system prompt and
           first message, seen before the restart) load from disk.
Reported: TTFT p50/p95 of later turns (all but the first) and of first turns, disk-tier hits from /metrics, and
how many replies are identical to the `none` run (greedy).
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from tessera.bench.client import scrape_metric as metric, wait_for_health


def run(mode: str, args, tier_dir: Path, out: Path) -> dict:
    port = args.port
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tessera", "serve", args.model, "--port", str(port),
           "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.concurrency), "--dtype", args.dtype]
    if mode != "none":
        cmd += ["--kv-offload-dir", str(tier_dir), "--kv-offload-size", "8GiB"]
    log = open(out / f"server-{mode}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_health(url, proc, str(out / f"server-{mode}.log"))
        result = out / f"{mode}.json"
        subprocess.run([sys.executable, "-m", "tessera", "bench", "serve", "--base-url", url, "--model", args.model,
                        "--dataset", "multi-turn", "--turns", str(args.turns), "--max-tokens", args.max_tokens, "--concurrency", str(args.concurrency),
                        "--num-prompts", str(args.requests), "--warmup", "0", "--seed", str(args.seed),
                        *(["--max-active-conversations", str(args.max_active_conversations)]
                          if args.max_active_conversations else []),
                        "--no-progress", "--label", mode, "--output", str(result)], check=True)
        hits = metric(url, "tessera:external_prefix_cache_hits_total")
        ram_hits = metric(url, "tessera:prefix_cache_hits_total")
        saved = metric(url, "tessera:kv_offload_saved_seconds_total")
        stats = httpx.get(url + "/v1/engine/stats", timeout=10).json()["kv_cache"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    doc = json.loads(result.read_text())
    recs = doc["runs"][0]["requests"]
    later = [r["ttft"] for r in recs if r["ok"] and r["turn"] >= 1]
    first = [r["ttft"] for r in recs if r["ok"] and r["turn"] == 0]

    def pct(xs, p):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else None

    return {"mode": mode, "requests": len(recs), "failed": sum(not r["ok"] for r in recs),
            "ttft_later_turns_p50_s": statistics.median(later), "ttft_later_turns_p95_s": pct(later, 95),
            "ttft_first_turns_p50_s": statistics.median(first), "disk_hit_tokens": hits, "ram_hit_tokens": ram_hits,
            "saved_s": saved, "offload": stats.get("offload"),
            "replies": {f"{r['session']}:{r['turn']}": r.get("text_sha256") for r in recs}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--kv-cache-memory", default="16MiB", help="RAM KV budget, far below the conversations")
    p.add_argument("--requests", type=int, default=36, help="requests in all (turns of all conversations)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", default="16:32")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-active-conversations", type=int, default=0,
                   help="conversations under way at once, their turns sent round-robin (tessera bench serve's "
                        "option): a conversation's next turn waits behind the others', as a user's does; 0: each "
                        "client runs one conversation to its end, turns back to back")
    p.add_argument("--dtype", default="auto", help="the servers' --dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tier_dir = Path(tempfile.mkdtemp(prefix="tessera-kv-tier-"))
    try:
        rows = [run(mode, args, tier_dir, args.out) for mode in ("none", "tier", "restart")]
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)
    base = rows[0]
    for r in rows:
        r["later_turns_ttft_speedup"] = base["ttft_later_turns_p50_s"] / r["ttft_later_turns_p50_s"]
        same = [k for k, v in r["replies"].items() if v is not None and base["replies"].get(k) == v]
        r["replies_identical_to_none"] = f"{len(same)}/{len(r['replies'])}"
    for r in rows:
        del r["replies"]
        print(f"{r['mode']:8s} TTFT p50 later turns {r['ttft_later_turns_p50_s']:.3f} s "
              f"({r['later_turns_ttft_speedup']:.2f}x), first turns {r['ttft_first_turns_p50_s']:.3f} s, "
              f"disk hits {r['disk_hit_tokens']:.0f} tokens, RAM hits {r['ram_hit_tokens']:.0f}, "
              f"identical replies {r['replies_identical_to_none']}", flush=True)
    from tessera.bench.machine import machine_info

    (args.out / "summary.json").write_text(json.dumps({"config": vars(args) | {"out": str(args.out)},
                                                       "machine": machine_info(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
