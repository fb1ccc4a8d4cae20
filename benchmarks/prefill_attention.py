"""Prefill attention: the paged backend's C kernel (tessera/kernels/prefill_attention.c) against
SDPA, per call and inside the steps of a 32-request burst, in one process.

1. Kernel: one layer's attention for a step's prompts (fresh, causal), the C kernel reading the
   paged cache against PyTorch's causal SDPA call per prompt (what the backends did before), on
   SmolLM2-135M's heads (9 query, 3 KV, 64 wide) and Qwen2.5-1.5B's (12, 2, 128); medians.
   Long contexts: one 2,048-row chunk ending at 8k, 16k and 32k tokens (the rest cached, as an
   agent's prompt arrives) on Qwen2.5-1.5B's heads, the kernel against the `sdpa` backend's path
   for it (the context gathered from the paged cache, one masked SDPA call).
2. Burst: 32 `random` prompts (the c=32 workload's first 32, as the benchmark client sends them
   at once) added to an engine at once, stepped until all have their first token, with the
   model's layers timed by part (projections, attention, norms, the rest); once with the `paged`
   backend's prefill kernel and once with it turned off (prefill rows then take the `sdpa`
   backend's path, as before the kernel; decodes stay on the paged kernel), alternating. The
   prompt-carrying steps and the 16th, 28th and 32nd first tokens (the 28th of 32 is the burst's
   share of the c=32 run's TTFT p95) are reported.

    python benchmarks/prefill_attention.py --out benchmarks/results/prefill_attention/prefill_attention.json
    python benchmarks/prefill_attention.py --kernel-only    # part 1 alone: no model needed
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def median_ms(fn, repeats: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def kernel_case(hq: int, hkv: int, d: int, lens: list[int]) -> dict:
    from tessera.kernels import attention_ops

    bs = 16
    nblocks = sum(-(-n // bs) for n in lens)
    cache = (torch.randn(2, hkv, nblocks, bs, d) * 0.5).to(torch.bfloat16)
    tables = torch.zeros(len(lens), max(-(-n // bs) for n in lens), dtype=torch.long)
    starts, used = [0], 0
    for i, n in enumerate(lens):
        k = -(-n // bs)
        tables[i, :k] = torch.arange(used, used + k)
        used += k
        starts.append(starts[-1] + n)
    t = starts[-1]
    q = torch.randn(t, hq, d).to(torch.bfloat16)
    k = torch.randn(t, hkv, d).to(torch.bfloat16)
    v = torch.randn(t, hkv, d).to(torch.bfloat16)
    scale = 1 / math.sqrt(d)
    plan = attention_ops.PrefillPlan.build(starts, lens, tables, None)

    def sdpa():
        for a, b in zip(starts[:-1], starts[1:]):
            F.scaled_dot_product_attention(q[a:b].transpose(0, 1).unsqueeze(0), k[a:b].transpose(0, 1).unsqueeze(0),
                                           v[a:b].transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                           enable_gqa=True)

    c_ms = median_ms(lambda: attention_ops.paged_prefill_attention(q, cache, plan, scale))
    sdpa_ms = median_ms(sdpa)
    gflop = sum(n * n / 2 * hq * d * 4 for n in lens) / 1e9
    row = {"heads": [hq, hkv, d], "prompts": lens, "c_ms": c_ms, "sdpa_ms": sdpa_ms, "speedup": sdpa_ms / c_ms,
           "c_gflops": gflop / c_ms * 1e3, "sdpa_gflops": gflop / sdpa_ms * 1e3}
    print(f"heads {hq}/{hkv}x{d} prompts {lens}: C {c_ms:.2f} ms ({row['c_gflops']:.0f} GFLOP/s), "
          f"SDPA {sdpa_ms:.2f} ms ({row['sdpa_gflops']:.0f}): {row['speedup']:.2f}x", flush=True)
    return row


def long_context_case(hq: int, hkv: int, d: int, chunk: int, context: int, repeats: int = 3) -> dict:
    """One chunk of `chunk` rows whose last is token `context` (the rest already cached), one layer:
    the C kernel against the `sdpa` backend's path for such a step (the one it takes without the
    kernel: an int8 cache, a host without AVX512-BF16)."""
    from tessera.kernels import attention_ops
    from tessera.attention.sdpa import SdpaBackend

    bs = 16
    nblocks = -(-context // bs)
    cache = (torch.randn(2, hkv, nblocks, bs, d) * 0.5).to(torch.bfloat16)
    table = list(range(nblocks))
    q = torch.randn(chunk, hq, d).to(torch.bfloat16)
    k = torch.randn(chunk, hkv, d).to(torch.bfloat16)
    v = torch.randn(chunk, hkv, d).to(torch.bfloat16)
    scale = 1 / math.sqrt(d)
    plan = attention_ops.PrefillPlan.build([0, chunk], [context], torch.tensor([table]), None)
    sdpa = SdpaBackend()
    meta = sdpa.build_metadata([chunk], [context], [table], bs)
    out = torch.empty_like(q)
    c_ms = median_ms(lambda: attention_ops.paged_prefill_attention(q, cache, plan, scale), repeats)
    sdpa_ms = median_ms(lambda: sdpa._prefill(q, k, v, cache, meta, scale, None, out), repeats)
    gflop = chunk * (context - (chunk - 1) / 2) * hq * d * 4 / 1e9
    row = {"heads": [hq, hkv, d], "chunk": chunk, "context": context, "c_ms": c_ms, "sdpa_ms": sdpa_ms,
           "speedup": sdpa_ms / c_ms, "c_gflops": gflop / c_ms * 1e3, "sdpa_gflops": gflop / sdpa_ms * 1e3}
    print(f"heads {hq}/{hkv}x{d} chunk {chunk} ending at {context}: C {c_ms:.0f} ms ({row['c_gflops']:.0f} "
          f"GFLOP/s), SDPA path {sdpa_ms:.0f} ms ({row['sdpa_gflops']:.0f}): {row['speedup']:.2f}x", flush=True)
    return row


class PartTimer:
    """Wall time of each decoder layer part, summed over a step (CPU ops are synchronous)."""

    PARTS = {"qkv": ("self_attn", "qkv_proj"), "o": ("self_attn", "o_proj"), "gate_up": ("mlp", "gate_up_proj"),
             "down": ("mlp", "down_proj"), "attention": ("self_attn", "attn"), "norm": ("input_layernorm",),
             "norm ": ("post_attention_layernorm",)}

    def __init__(self, model: torch.nn.Module) -> None:
        self.acc: collections.Counter = collections.Counter()
        for layer in model.model.layers:
            for part, path in self.PARTS.items():
                module = layer
                for name in path:
                    module = getattr(module, name)
                self._wrap(module, part.strip())

    def _wrap(self, module: torch.nn.Module, part: str) -> None:
        forward = module.forward

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.acc[part] += time.perf_counter() - start

        module.forward = timed


def burst(variant: str, seed: int, engines: dict) -> dict:
    from tessera.bench.datasets import random_workload
    from tessera.llm import LLM
    from tessera.sampling_params import SamplingParams

    if variant not in engines:
        llm = LLM("smollm2-135m", profile="bursty", attention_backend="paged")
        llm.engine.runner.backend._prefill_c = variant == "c"
        engines[variant] = (llm.engine, PartTimer(llm.engine.runner.model))
    engine, timer = engines[variant]
    for s in random_workload(32, seed):
        turn = s.turns[0]
        engine.add_request(f"{variant}-{seed}-{s.session_id}", turn.prompt,
                           SamplingParams(max_tokens=turn.max_tokens, ignore_eos=True, temperature=0))
    start = time.perf_counter()
    first, steps = [], []
    while engine.has_unfinished_requests():
        timer.acc.clear()
        t0 = time.perf_counter()
        _, stats = engine.step_with_stats()
        wall = time.perf_counter() - t0
        first.extend(stats.time_to_first_tokens)
        if stats.num_prompt_tokens:
            parts = {k: round(v * 1e3, 1) for k, v in timer.acc.items()}
            parts["rest"] = round((wall - sum(timer.acc.values())) * 1e3, 1)
            steps.append({"ms": round(wall * 1e3, 1), "prompt_tokens": stats.num_prompt_tokens,
                          "sampled": stats.num_generation_tokens, "parts_ms": parts})
    first.sort()
    row = {"prefill_attention": variant, "seed": seed, "ttft_16th_s": first[15], "ttft_28th_s": first[27],
           "ttft_32nd_s": first[31], "total_s": time.perf_counter() - start, "prompt_steps": steps}
    mean = {k: statistics.mean(s["parts_ms"].get(k, 0.0) for s in steps[:-1] or steps)
            for k in steps[0]["parts_ms"]}
    print(f"{variant:4s} seed {seed}: first tokens 16th {first[15]:.2f} s, 28th {first[27]:.2f} s, 32nd "
          f"{first[31]:.2f} s; prompt steps {len(steps)}, full ones {statistics.mean(s['ms'] for s in steps[:-1] or steps):.0f} "
          "ms: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(mean.items(), key=lambda kv: -kv[1])), flush=True)
    return row


def main() -> None:
    from tessera.bench.machine import machine_info

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2, help="bursts of each variant (alternated)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--kernel-only", action="store_true", help="the per-call cases only, no bursts")
    args = p.parse_args()
    torch.manual_seed(0)
    kernel_rows = [kernel_case(9, 3, 64, [250] * 4), kernel_case(9, 3, 64, [300, 250, 200, 150, 100]),
                   kernel_case(9, 3, 64, [1000]), kernel_case(12, 2, 128, [512])]
    long_rows = [long_context_case(12, 2, 128, 2048, n) for n in (8192, 16384, 32768)]
    bursts = [] if args.kernel_only else run_bursts(args.repeats)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"kernel": kernel_rows, "long_context": long_rows, "bursts": bursts,
                                        "machine": machine_info()}, indent=1))


def run_bursts(repeats: int) -> list:
    """Part 2: a warm-up burst per variant, then `repeats` rounds of both, alternated."""
    engines: dict = {}
    for variant in ("c", "sdpa"):  # a warm-up burst each (its own prompts: no prefix hits later)
        burst(variant, 1, engines)
    bursts = []
    for i in range(repeats):
        for variant in (("c", "sdpa") if i % 2 == 0 else ("sdpa", "c")):
            bursts.append(burst(variant, 3000 + 17 * i, engines))
    return bursts


if __name__ == "__main__":
    main()
