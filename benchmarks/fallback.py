"""Degradation to a smaller model under load: a saturated model's overflow answered by its
fallback instead of 429, measured with `tessera bench serve` and a model mix against the same load
without the rule.

    flock /tmp/tessera-bench.lock python benchmarks/fallback.py --out benchmarks/results/fallback

Two servers in turn, each serving BIG and SMALL from one port (`--config`, both preloaded, each in
its own engine process). BIG is kept small on purpose (`max_num_seqs`, `max_num_queued_requests`)
so that the offered load, Poisson arrivals with a mix of models (`--mix`, mostly BIG), saturates
it; each engine gets one torch thread (two engines share 2 cores) and SMALL its own
`max_queue_wait`, so it refuses what it could not start in time rather than queueing past the SLO.
Arm `no-rule`: BIG has no fallback, its overflow is refused with 429. Arm `rule`: `fallback =
SMALL`, `when = ["queue_full", "queue_wait > W"]`. The load is `tessera bench serve --model
BIG=a,SMALL=b --request-rate R` (same seed in both arms: the same requests ask for the same model
at the same times); its JSON records, per request, the model asked for, who answered
(`x-tessera-model`) and why (`x-tessera-fallback-cause`). Writes <arm>.json, fallback.json and
prints the table for docs/serving.md ("Several models").
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tessera.bench.client import launch_server, stop_server
from tessera.bench.machine import machine_info


def toml(args: argparse.Namespace, rule: bool) -> str:
    fallback = (f'fallback = "{args.small}"\nwhen = ["queue_full", "queue_wait > {args.max_wait}s"]\n'
                if rule else "")
    return (f'[[model]]\nname = "{args.big}"\nmodel = "{args.big}"\npreload = true\n{fallback}'
            f"max_num_queued_requests = {args.big_queue}\n[model.engine]\nmax_num_seqs = {args.big_seqs}\n"
            f"num_threads = {args.threads}\n\n"
            f'[[model]]\nname = "{args.small}"\nmodel = "{args.small}"\npreload = true\n'
            f"max_queue_wait = {args.small_max_wait}\n[model.engine]\nnum_threads = {args.threads}\n")


def bench_serve(args: argparse.Namespace, url: str, arm: str) -> dict:
    """One `tessera bench serve` run of the mix; its JSON document."""
    out = args.out / f"{arm}.json"
    cmd = [sys.executable, "-m", "tessera", "bench", "serve", "--base-url", url,
           "--model", f"{args.big}={args.mix[0]},{args.small}={args.mix[1]}",
           "--request-rate", str(args.rate), "--num-prompts", str(args.num_prompts),
           "--prompt-words", "50:200", "--max-tokens", str(args.max_tokens), "--slo-ttft", str(args.slo_ttft),
           "--seed", str(args.seed), "--label", arm, "--no-progress", "--output", str(out)]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def row(arm: str, doc: dict, big: str, small: str) -> str:
    run = doc["runs"][0]
    m = run["models"]
    a_big, a_small = m["asked"].get(big, {}), m["asked"].get(small, {})
    deg = m["degraded"]
    fmt = lambda v: "-" if v is None else f"{v:.2f} s"  # noqa: E731
    within = "-" if deg["within_slo"] is None else f"{deg['within_slo']:.0%}"
    by = a_big.get("answered_by", {})
    causes = ", ".join(f"{n} {c}" for c, n in sorted(deg["causes"].items()))
    return (f"| {arm} | {run['summary']['num_requests']} | {a_big.get('requests', 0)} | {by.get(big, 0)} | "
            f"{by.get(small, 0)}{f' ({causes})' if causes else ''} | {a_big.get('rejected_429', 0)} | "
            f"{a_small.get('requests', 0)} / {a_small.get('rejected_429', 0)} | {fmt(deg['ttft_s']['p95'])} | "
            f"{within} | "
            f"{fmt(m['answered'].get(big, {}).get('ttft_s', {}).get('p95'))} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--big", default="qwen2.5-coder-0.5b")
    p.add_argument("--small", default="smollm2-135m")
    p.add_argument("--mix", type=float, nargs=2, default=(4.0, 1.0), metavar=("BIG", "SMALL"),
                   help="weights of the two models in the requests (default: 4 1)")
    p.add_argument("--big-seqs", type=int, default=4)
    p.add_argument("--big-queue", type=int, default=2)
    p.add_argument("--max-wait", type=float, default=1.0, help="the rule's queue_wait bound, seconds")
    p.add_argument("--small-max-wait", type=float, default=1.0,
                   help="the fallback's own --max-queue-wait: it refuses what it could not start in time")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per engine: two engines share the machine's cores")
    p.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson)")
    p.add_argument("--num-prompts", type=int, default=90)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--port", type=int, default=8119)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    results: dict = {"machine": machine_info(), "settings": {k: str(v) for k, v in vars(args).items()}}
    lines = ["| arm | requests | asked BIG | BIG answered by BIG | BIG answered by SMALL (cause) | BIG 429 | "
             "asked SMALL / 429 | TTFT p95, degraded | degraded within SLO | TTFT p95, BIG |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm in ("no-rule", "rule"):
        config = args.out / f"{arm}.toml"
        config.write_text(toml(args, arm == "rule"))
        proc = launch_server(args.big, args.port, args.out / f"server_{arm}.log", "--config", str(config))
        try:
            doc = bench_serve(args, url, arm)
        finally:
            stop_server(proc)
        results[arm] = doc["runs"][0]["models"] | {"summary": doc["runs"][0]["summary"]}
        lines.append(row(arm, doc, args.big, args.small))
    (args.out / "fallback.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
