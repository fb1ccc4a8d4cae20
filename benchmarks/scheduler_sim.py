"""The scheduler alone under a step-cost model: Poisson arrivals of two priority classes run through
the real `Scheduler` on a virtual clock, each step lasting what a linear cost model predicts. No
model, no server, no noise from the host: it shows what the policy does (where a class's TTFT goes,
how long an overload takes to drain) in seconds of CPU, for comparing policies on one tree or two.

    python benchmarks/scheduler_sim.py --out benchmarks/results/scheduler_sim

The default cost model approximates SmolLM2-135M on one core of an x86 server (a 25 ms step base,
4 ms a decode row, 3.5 ms a prompt token; a whole 1,024-token budget of prompts ~3.6 s) and the
default load is benchmarks/batch_gaps.py's priority run (priority 0 at 0.535 req/s, priority 10
at 1.07 req/s on top, 90-200-token prompts, 64 tokens out, --max-num-seqs 16, the bursty profile).
Its figures are the policy's, not a host's: a real server's are measured by batch_gaps.py.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from tessera.config import EngineConfig
from tessera.engine.core.cost_model import StepShape
from tessera.engine.core.kv_cache_manager import KVCacheManager
from tessera.engine.core.request import Request
from tessera.engine.core.scheduler import Scheduler
from tessera.sampling_params import SamplingParams


@dataclass(frozen=True)
class LinearCost:
    """Seconds a step takes: a base, a cost per sampled row and per prompt token."""

    base: float
    row: float
    token: float

    def predict(self, shape: StepShape) -> float:
        if not shape.num_tokens:
            return 0.0
        return self.base + self.row * shape.num_sampled + self.token * max(0, shape.num_tokens - shape.num_sampled)


def pct(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def simulate(args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    config = EngineConfig(max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs, block_size=16,
                          enable_prefix_caching=False, preemption_mode="swap", target_itl_ms=args.target_itl_ms,
                          min_prefill_chunk=args.min_prefill_chunk, scheduling_policy="priority")
    cost = LinearCost(args.step_base, args.row_cost, args.token_cost)
    sched = Scheduler(config, KVCacheManager(args.blocks, 16, False), 4096, cost)
    arrivals: list[tuple[float, int]] = []
    for priority, rate in ((0, args.rate0), (10, args.rate10)):
        t = rng.expovariate(rate)
        while t < args.seconds:
            arrivals.append((t, priority))
            t += rng.expovariate(rate)
    arrivals.sort()
    life: dict[str, dict] = {}
    now, i, steps = 0.0, 0, 0
    while i < len(arrivals) or sched.has_unfinished():
        while i < len(arrivals) and arrivals[i][0] <= now:
            t, priority = arrivals[i]
            rid = f"r{i}"
            i += 1
            prompt = [rng.randint(5, 1000) for _ in range(rng.randint(args.prompt_min, args.prompt_max))]
            sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=args.output, priority=priority),
                                      args.output, [0], arrival_time=t))
            life[rid] = {"arrival": t, "priority": priority, "first": None}
        out = sched.schedule()
        if not out.scheduled:  # idle until the next arrival
            now = arrivals[i][0] if i < len(arrivals) else now
            continue
        now += cost.predict(out.shape)
        steps += 1
        sampled = {c.request_id: [7] for c in out.scheduled if c.samples}
        for rid in sampled:
            if life[rid]["first"] is None:
                life[rid]["first"] = now
        sched.update_after_step(out, sampled)
    classes = {}
    for priority in (0, 10):
        ttft = [r["first"] - r["arrival"] for r in life.values() if r["priority"] == priority]
        classes[str(priority)] = {"requests": len(ttft), "ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95),
                                  "ttft_max": max(ttft) if ttft else None}
    return {"seed": seed, "steps": steps, "drained_at_s": now, "by_priority": classes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--rate0", type=float, default=0.535, help="priority-0 arrivals a second")
    ap.add_argument("--rate10", type=float, default=1.07, help="priority-10 arrivals a second")
    ap.add_argument("--prompt-min", type=int, default=90)
    ap.add_argument("--prompt-max", type=int, default=200)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--budget", type=int, default=1024, help="--max-num-batched-tokens")
    ap.add_argument("--target-itl-ms", type=float, default=50.0)
    ap.add_argument("--min-prefill-chunk", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=4000)
    ap.add_argument("--step-base", type=float, default=0.025)
    ap.add_argument("--row-cost", type=float, default=0.004)
    ap.add_argument("--token-cost", type=float, default=0.0035)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs = [simulate(args, seed) for seed in range(args.seeds)]
    summary = {str(p): {k: pct([r["by_priority"][str(p)][k] for r in runs], 0.5) for k in ("ttft_p50", "ttft_p95")}
               for p in (0, 10)}
    summary["drained_at_s"] = pct([r["drained_at_s"] for r in runs], 0.5)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"kind": "scheduler_sim", "commit": commit, "cost_model": asdict(LinearCost(args.step_base, args.row_cost,
                                                                                         args.token_cost)),
              "args": {k: str(v) for k, v in vars(args).items()}, "median_over_seeds": summary, "runs": runs}
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"scheduler_sim_{commit}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
