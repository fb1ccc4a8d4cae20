"""Prefill/decode disaggregation against two mixed replicas, side by side.

    flock /tmp/tessera-bench.lock .venv/bin/python benchmarks/pd.py --out benchmarks/results/pd
    .venv/bin/python benchmarks/pd.py --ray --out ...     # the replicas as Ray actors (local Ray)

Two replicas of one model, one CPU core each, in both arms: `mixed` (`--replicas 2
--router-policy least-loaded`: each replica prefills and decodes) and `pd` (`--pd
prefill=1,decode=1`: one replica computes prompts and hands their KV blocks to the other, which
only decodes). The workload mixes long prompts with running streams (random prompts of 20 to
1,200 words, 64-128 output tokens, 8 concurrent clients), where a long prefill on a mixed
replica stalls every stream it is decoding. The arms alternate (mixed, pd, then pd, mixed) so
drift hits both alike. Writes one bench JSON per run, the server logs and summary.json
(medians per arm: ITL p50/p95, TTFT p50/p95, output tok/s; the KV handed over).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import httpx

from tessera.bench.client import launch_server, stop_server
from tessera.bench.machine import machine_info

ARMS = {"mixed": ["--replicas", "2", "--router-policy", "least-loaded"], "pd": ["--pd", "prefill=1,decode=1"]}


def one_run(args, arm: str, rnd: int) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    tag = f"{arm}_r{rnd}"
    flags = ARMS[arm] + ["--kv-cache-memory", "512MiB", "--max-model-len", "2048", "--disable-log-stats"]
    if args.ray:
        flags += ["--ray"]
    proc = launch_server(args.model, args.port, args.out / f"server_{tag}.log", *flags)
    try:
        bench = args.out / f"{tag}.json"
        subprocess.run([sys.executable, "-m", "tessera", "bench", "serve", "--base-url", url, "--model", args.model,
                        "--label", arm, "--dataset", "random", "--prompt-words", "20:1200", "--max-tokens", "64:128",
                        "--concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts),
                        "--seed", str(rnd), "--warmup", "2", "--no-progress", "--output", str(bench)], check=True)
        core = httpx.get(f"{url}/v1/engine/stats", timeout=30).json()["engine_core"]
    finally:
        stop_server(proc)
    s = json.loads(bench.read_text())["runs"][0]["summary"]
    return {"arm": arm, "round": rnd, "itl_p50_ms": s["itl_s"]["p50"] * 1e3, "itl_p95_ms": s["itl_s"]["p95"] * 1e3,
            "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p95_s": s["ttft_s"]["p95"],
            "output_tokens_per_s": s["output_tokens_per_s"], "failed": s["failed"], "pd": core.get("pd")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--ray", action="store_true", help="replicas as Ray actors instead of local processes")
    p.add_argument("--port", type=int, default=8121)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for rnd in range(1, args.rounds + 1):
        for arm in (("mixed", "pd") if rnd % 2 else ("pd", "mixed")):
            runs.append(one_run(args, arm, rnd))
            print(json.dumps(runs[-1]), flush=True)
    keys = ("itl_p50_ms", "itl_p95_ms", "ttft_p50_s", "ttft_p95_s", "output_tokens_per_s")
    med = {arm: {k: statistics.median(r[k] for r in runs if r["arm"] == arm) for k in keys} for arm in ARMS}
    result = {"kind": "pd", "machine": machine_info(), "model": args.model,
              "settings": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "median": med,
              "itl_p95_ratio_mixed_over_pd": med["mixed"]["itl_p95_ms"] / med["pd"]["itl_p95_ms"]}
    (args.out / "summary.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("median", "itl_p95_ratio_mixed_over_pd")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
