"""Gemma 3's sliding-window layers with and without the hybrid KV cache manager.

    flock /tmp/tessera-bench.lock python benchmarks/kv_groups.py \\
        --out benchmarks/results/kv_groups.json

Two engines of the same model in one process, one hybrid (the default: sliding-window layers keep
only their window's blocks, tessera/attention/kv_groups.py) and one plain
(`--disable-hybrid-kv-cache-manager`: every layer keeps the whole context), each given the same
`--kv-cache-memory`:
- capacity: pool blocks, the longest sequence they hold, and how many sequences of
  --max-model-len tokens fit at once (from the engines' own accounting);
- same outputs: greedy tokens of a --prompt-tokens prompt (gfdl text) from both engines;
- decode step time with --batch requests each holding --context tokens, the two engines stepped
  in alternation (A B A B ...) so drift hits both alike; medians (these two engines get
  --timing-kv-memory, room for every batch in both layouts, so no step preempts);
- a fixed-memory load: --load-requests prompts of --context tokens submitted at once, decoded for
  --load-tokens tokens: wall time, preemptions, and the most requests running in one step.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "gfdl-1.3-head.txt"


def make_engine(model: str, hybrid: bool, args: argparse.Namespace, memory_mib: int):
    from tessera.llm import LLM

    return LLM(model, max_model_len=args.max_model_len, kv_cache_memory=memory_mib << 20,
               max_num_seqs=max(args.batch + [args.load_requests]), enable_prefix_caching=False,
               disable_hybrid_kv_cache_manager=not hybrid, dtype=args.dtype, target_itl_ms=0,
               preemption_mode="recompute")


def context_ids(llm, n: int) -> list[int]:
    ids = llm.tokenizer.encode(TEXT.read_text())
    return (ids * (1 + n // len(ids)))[:n]


def decode_times(engines: dict, ids: list[int], batch: int, steps: int) -> dict[str, float]:
    """Median decode step of `batch` requests holding len(ids) tokens, engines alternating."""
    from tessera.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for name, llm in engines.items():
        for i in range(batch):
            llm.engine.add_request(f"{name}-{batch}-{i}", ids[i:] + ids[:i], params)  # distinct rows
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in llm.engine.scheduler.requests.values()):
            llm.engine.step()  # prefill (and a first decode) outside the timing
        llm.engine.step()
    times: dict[str, list[float]] = {n: [] for n in engines}
    for _ in range(steps):
        for name, llm in engines.items():
            t0 = time.perf_counter()
            llm.engine.step()
            times[name].append(time.perf_counter() - t0)
    for llm in engines.values():
        for rid in list(llm.engine.scheduler.requests):
            llm.engine.abort_request(rid)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    return {n: 1e3 * statistics.median(t) for n, t in times.items()}


def fixed_memory_load(llm, ids: list[int], requests: int, tokens: int) -> dict:
    from tessera.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(requests):
        llm.engine.add_request(f"load-{i}", ids[7 * i:] + ids[:7 * i], params)
    preemptions, most_running = 0, 0
    t0 = time.perf_counter()
    while llm.engine.has_unfinished_requests():
        _, stats = llm.engine.step_with_stats()
        preemptions += stats.num_preemptions
        most_running = max(most_running, len(llm.engine.scheduler.running))
    return {"wall_s": time.perf_counter() - t0, "preemptions": preemptions, "most_running": most_running}


def main() -> None:
    from tessera.sampling_params import SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kv-cache-memory", type=int, default=96, help="MiB, the same for both engines")
    p.add_argument("--timing-kv-memory", type=int, default=1024, help="MiB for the decode-timing engines")
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--gen-tokens", type=int, default=48)
    p.add_argument("--context", type=int, default=2000)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--load-requests", type=int, default=12)
    p.add_argument("--load-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    engines = {"hybrid": make_engine(args.model, True, args, args.timing_kv_memory),
               "plain": make_engine(args.model, False, args, args.timing_kv_memory)}
    ids = context_ids(engines["hybrid"], max(args.context, args.prompt_tokens) + 64)
    result: dict = {"model": args.model, "settings": {k: v for k, v in vars(args).items() if k != "out"},
                    "capacity": {}, "decode_step_ms": {}, "load": {}}
    greedy = SamplingParams(max_tokens=args.gen_tokens, temperature=0.0, ignore_eos=True)
    outs = {n: llm.generate([ids[:args.prompt_tokens]], greedy)[0].outputs[0].token_ids for n, llm in engines.items()}
    result["same_greedy_tokens"] = outs["hybrid"] == outs["plain"]
    print(f"greedy {args.gen_tokens} tokens after {args.prompt_tokens}: same = {result['same_greedy_tokens']}",
          flush=True)
    for b in args.batch:
        result["decode_step_ms"][str(b)] = decode_times(engines, ids[:args.context], b, args.steps)
        print(f"decode step, batch {b} at {args.context} tokens: " + ", ".join(
            f"{n} {ms:.1f} ms" for n, ms in result["decode_step_ms"][str(b)].items()), flush=True)
    del engines
    gc.collect()
    engines = {"hybrid": make_engine(args.model, True, args, args.kv_cache_memory),
               "plain": make_engine(args.model, False, args, args.kv_cache_memory)}
    for name, llm in engines.items():
        info = llm.engine.kv_cache_info()
        per_seq = llm.engine.kv_groups.blocks_per_sequence(args.max_model_len, info["block_size"],
                                                          llm.engine.config.max_num_batched_tokens)
        result["capacity"][name] = {"groups": info["groups"], "num_blocks": info["num_blocks"],
                                    "max_sequence_tokens": info["max_sequence_tokens"],
                                    "blocks_per_max_len_sequence": per_seq,
                                    "max_len_sequences": (info["num_blocks"] - llm.engine.kv_groups.hybrid) // per_seq,
                                    "tokens_per_gib": info["tokens_per_gib"]}
        print(f"{name:6s} {info['groups']}: {info['num_blocks']} blocks, longest sequence "
              f"{info['max_sequence_tokens']} tokens, {result['capacity'][name]['max_len_sequences']} sequences "
              f"of {args.max_model_len}", flush=True)
    for name, llm in engines.items():
        result["load"][name] = fixed_memory_load(llm, ids[:args.context], args.load_requests, args.load_tokens)
        print(f"{name:6s} load of {args.load_requests} x {args.context} tokens: {result['load'][name]}", flush=True)
    if args.out:
        from tessera.hostinfo import cpu_model_name
        import torch

        result["machine"] = {"cpu": cpu_model_name(), "threads": torch.get_num_threads(), "torch": torch.__version__}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
