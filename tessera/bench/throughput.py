"""Offline throughput: the same seeded workload through continuous and static batching.

Both policies run in one process on one loaded model, one after the other, so
the ratio between them is measured under the same machine conditions.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from tessera.bench.datasets import random_workload
from tessera.engine.args import add_engine_args, config_from_args
from tessera.engine.llm_engine import LLMEngine
from tessera.sampling_params import SamplingParams


def run_policy(engine: LLMEngine, prompts: list[str], max_tokens: list[int], label: str) -> dict:
    """Submit every request at t=0 and step until all finish."""
    start = time.perf_counter()
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"{label}-{i}", p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
    out_tokens = prompt_tokens = steps = 0
    with tqdm(total=len(prompts), desc=label, unit="req", leave=False) as bar:
        while engine.has_unfinished_requests():
            outputs, stats = engine.step_with_stats()
            steps += 1
            prompt_tokens += stats.num_prompt_tokens
            out_tokens += stats.num_generation_tokens
            bar.update(sum(1 for o in outputs if o.finished))
    elapsed = time.perf_counter() - start
    return {"policy": label, "elapsed_s": elapsed, "output_tokens": out_tokens,
            "prompt_tokens_computed": prompt_tokens, "steps": steps,
            "output_tokens_per_s": out_tokens / elapsed, "requests_per_s": len(prompts) / elapsed}


def main(args: argparse.Namespace) -> int:
    from tessera.models.loader import load_model
    from tessera.models.registry import resolve_model

    base = config_from_args(args, args.model)
    loaded = load_model(resolve_model(base.model), base.dtype, base.num_threads)
    sessions = random_workload(args.num_prompts, args.workload_seed, (args.min_words, args.max_words),
                               (args.min_tokens, args.max_tokens))
    prompts = [s.turns[0].prompt for s in sessions]
    max_tokens = [s.turns[0].max_tokens for s in sessions]
    runs: dict[str, list[dict]] = {"continuous": [], "static": []}
    for rep in range(args.repeats):
        for policy in ("continuous", "static"):
            engine = LLMEngine(replace(base, scheduler_policy=policy), loaded=loaded)
            r = run_policy(engine, prompts, max_tokens, policy)
            runs[policy].append(r)
            print(f"[{rep + 1}/{args.repeats}] {policy:10s} {r['output_tokens_per_s']:8.1f} output tok/s "
                  f"({r['elapsed_s']:.1f} s, {r['steps']} steps)")
    med = {p: statistics.median(r["output_tokens_per_s"] for r in rs) for p, rs in runs.items()}
    ratio = med["continuous"] / med["static"]
    print(f"continuous {med['continuous']:.1f} tok/s, static {med['static']:.1f} tok/s, "
          f"ratio {ratio:.2f}x (medians of {args.repeats})")
    result = {
        "benchmark": "throughput", "model": args.model, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": __import__("os").cpu_count()},
        "engine": {k: v for k, v in vars(base).items()}, "dtype": str(loaded.dtype),
        "workload": {"num_prompts": args.num_prompts, "seed": args.workload_seed,
                     "prompt_words": [args.min_words, args.max_words],
                     "output_tokens": [args.min_tokens, args.max_tokens], "ignore_eos": True},
        "runs": runs, "median_output_tokens_per_s": med, "ratio_continuous_over_static": ratio,
    }
    if args.output:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")
        _plot(result, path.with_suffix(".png"))
    return 0


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = result["median_output_tokens_per_s"]
    fig, ax = plt.subplots(figsize=(5, 4))
    bars = ax.bar(list(med), list(med.values()), color=["#2a7", "#a52"])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tokens/s (median)")
    ax.set_title(f"{result['model']}: {result['workload']['num_prompts']} requests, "
                 f"ratio {result['ratio_continuous_over_static']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput: continuous vs static batching",
                       description=__doc__)
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the generated prompts")
    p.add_argument("--min-words", type=int, default=50)
    p.add_argument("--max-words", type=int, default=400)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1, help="runs of each policy; medians are reported")
    p.add_argument("--output", default=None, help="JSON result path (a PNG plot is written beside it)")
    add_engine_args(p)
    p.set_defaults(func=main)
