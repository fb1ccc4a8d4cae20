"""Where one engine step's time goes: decode-step timings, a roofline, and an op profile.

For each batch size, B requests with ~200-token prompts are prefilled, then the
engine runs decode-only steps; the median step time is compared with two
floors measured on this machine in the same run:
- bandwidth floor: bytes of weights read per step / measured memory-copy bandwidth (read + write
  counted, so a floor no kernel can beat);
- compute floor: FLOPs of the step (2 x params x tokens) / the measured dense matmul rate in the
  engine's dtype.
A torch.profiler table of one decode step says which operators take the time.
With `--mixed K ...`, the largest batch's decodes are also timed next to one prompt chunk of K
tokens (the engine then runs with no latency target and a budget that holds the chunk, so the
step carries all K): what a prompt chunk adds to a step, against the decode-only steps timed
between them, which the scheduler's chunk sizing trades against.

    python benchmarks/step_profile.py --model smollm2-135m --quantization auto --batch 1 32 \\
        --out benchmarks/results/step_profile_auto.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch


def copy_bandwidth() -> float:
    """Bytes/s of a large tensor copy (read + write counted)."""
    src = torch.empty(256 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


def matmul_rate(dtype: torch.dtype = torch.bfloat16, n: int = 2048) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def weight_bytes(model: torch.nn.Module, rows: int) -> tuple[int, int]:
    """(bytes of weights a decode step of `rows` rows reads, their parameter count): the linears,
    LM head included, as the step reads them: quantized for small steps, the dense copy (where
    kept) for large ones."""
    from tessera.layers import Linear

    if not any(isinstance(m, Linear) for m in model.modules()):  # a model of plain 2-D parameters
        mats = [p for p in model.parameters() if p.dim() == 2]
        return sum(p.numel() * p.element_size() for p in mats), sum(p.numel() for p in mats)
    total, params = 0, 0
    for m in model.modules():
        if isinstance(m, Linear):
            dense = getattr(m, "dense_weight", None)
            large = rows > m.quant.small_batch_max and dense is not None
            total += dense.numel() * dense.element_size() if large else m.quant_method.nbytes(m)
            params += m.input_size * m.output_size
    return total, params


def run(args: argparse.Namespace) -> dict:
    from tessera import LLM, SamplingParams
    from tessera.bench.machine import machine_info

    torch.set_num_threads(args.num_threads or torch.get_num_threads())
    options = {k: v for k, v in (("quantization", args.quantization), ("dense_weight_copy", args.dense_weight_copy),
                                 ("attention_backend", args.attention_backend)) if v is not None}
    max_seqs = max(args.batch)
    if args.mixed:  # steps carry the whole chunk: no latency target, a budget that holds it, a slot for it
        options.update(target_itl_ms=0, max_num_batched_tokens=max(args.mixed) + max(args.batch))
        max_seqs += 1
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max_seqs, enable_prefix_caching=False,
              enforce_eager=args.enforce_eager, int8_activations=args.int8_activations, **options)
    engine = llm.engine
    model = engine.runner.model
    bw, rate = copy_bandwidth(), matmul_rate(engine.dtype)  # bfloat16 without native support: minutes
    prompt = ("The history of the city goes back many centuries, and its people have kept records " * 12)
    result = {"model": args.model, "options": options, "int8_activations": args.int8_activations, "prefix_caching": False, "dtype": str(engine.dtype),
              "copy_bandwidth_Bps": bw,
              "matmul_flops": rate, "machine": machine_info(), "python": platform.python_version(),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "batches": {}}
    if args.prefill:
        ids = engine.tokenizer.encode(prompt * 4)[:args.prefill]
        times = []
        for i in range(5):
            engine.add_request(f"prefill-{i}", ids, SamplingParams(max_tokens=1))
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            times.append(time.perf_counter() - t0)
        result["prefill"] = {"tokens": len(ids), "median_ms": statistics.median(times) * 1e3,
                             "tokens_per_s": len(ids) / statistics.median(times)}
        print(f"prefill of {len(ids)} tokens: median {statistics.median(times) * 1e3:.1f} ms "
              f"({len(ids) / statistics.median(times):.0f} tok/s)", flush=True)
    for b in args.batch:
        params_s = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, temperature=0)
        for i in range(b):
            engine.add_request(f"b{b}-{i}", f"{i}: {prompt}", params_s)
        times = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            _, stats = engine.step_with_stats()
            dt = time.perf_counter() - t0
            if stats.num_prompt_tokens == 0 and stats.num_generation_tokens == b:
                times.append(dt)
        if not times:  # a latency target kept admitting prompts while earlier requests finished
            print(f"batch {b}: no decode-only step of {b} rows (raise --steps or lower --batch)", flush=True)
            continue
        med = statistics.median(times)
        wbytes, params = weight_bytes(model, b)
        floor_bw = wbytes / bw  # the definition: weight bytes / measured copy bandwidth
        floor_compute = 2 * params * b / rate
        entry = {"weights_read_bytes": wbytes, "linear_params": params, "decode_steps": len(times),
                 "median_step_ms": med * 1e3, "p90_step_ms": sorted(times)[int(0.9 * len(times))] * 1e3,
                 "tokens_per_s": b / med,
                 "bandwidth_floor_ms": floor_bw * 1e3, "compute_floor_ms": floor_compute * 1e3}
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            # Sampled (temperature 1) like a chat client; long enough that all b requests are still
            # decoding once the last prefill chunk is done.
            for i in range(b):
                engine.add_request(f"p{b}-{i}", f"{i}: {prompt}", SamplingParams(max_tokens=64, ignore_eos=True))
            while True:  # prefill first, then profile one decode-only step
                _, stats = engine.step_with_stats()
                if stats.num_prompt_tokens == 0:
                    break
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                _, stats = engine.step_with_stats()
            entry["profiled_step_rows"] = stats.num_generation_tokens
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)
            entry["profile"] = table
            while engine.has_unfinished_requests():
                engine.step()
        result["batches"][str(b)] = entry
        print(f"batch {b}: median decode step {med * 1e3:.2f} ms ({b / med:.1f} tok/s); floors: bandwidth "
              f"{floor_bw * 1e3:.2f} ms, compute {floor_compute * 1e3:.2f} ms", flush=True)
        if args.profile:
            print(entry["profile"])
    if args.mixed:
        result["mixed"] = mixed_steps(engine, max(args.batch), args.mixed, prompt)
    return result


def mixed_steps(engine, rows: int, chunks: list[int], prompt: str, repeats: int = 3) -> dict:
    """Median time of a step of `rows` decodes plus one K-token prompt, for each K, with the
    decode-only steps of the same rows timed in between (same context lengths, same run)."""
    from tessera import SamplingParams

    ids = engine.tokenizer.encode(prompt * 16)
    out = {"rows": rows, "chunks": {}}
    for k in chunks:
        if k > len(ids):
            ids = ids * (k // len(ids) + 1)
        for i in range(rows):
            engine.add_request(f"m{k}-{i}", f"{i}: {prompt}", SamplingParams(max_tokens=1024, ignore_eos=True, temperature=0))
        while True:  # every row decoding
            _, stats = engine.step_with_stats()
            if stats.num_prompt_tokens == 0 and stats.num_generation_tokens == rows:
                break
        mixed, decode = [], []
        for r in range(repeats):
            engine.add_request(f"m{k}-p{r}", ids[:k], SamplingParams(max_tokens=1))
            t0 = time.perf_counter()
            _, stats = engine.step_with_stats()
            dt = time.perf_counter() - t0
            if stats.num_prompt_tokens == k:
                mixed.append(dt)
            for _ in range(3):
                t0 = time.perf_counter()
                _, stats = engine.step_with_stats()
                dt = time.perf_counter() - t0
                if stats.num_prompt_tokens == 0 and stats.num_generation_tokens == rows:
                    decode.append(dt)
        for rid in engine.in_flight():
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        if not mixed or not decode:
            print(f"mixed {rows} + {k}: no step of that shape ran", flush=True)
            continue
        m, d = statistics.median(mixed) * 1e3, statistics.median(decode) * 1e3
        out["chunks"][str(k)] = {"mixed_step_ms": m, "decode_step_ms": d, "added_ms_per_prompt_token": (m - d) / k}
        print(f"{rows} decodes + {k} prompt tokens: {m:.1f} ms against {d:.1f} ms decode-only "
              f"(+{(m - d) / k:.3f} ms a prompt token)", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantization", default=None, help="engine default unless given")
    p.add_argument("--dense-weight-copy", default=None, help="engine default unless given")
    p.add_argument("--attention-backend", default=None, help="engine default unless given")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--prefill", type=int, default=256, help="also time one fresh prompt of this many tokens (0: no)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="decode steps through the modules, not one C call")
    p.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, default=True,
                   help="int8-quantized activations for K-quant and int4 weights (the engine's default: on)")
    p.add_argument("--mixed", type=int, nargs="*", default=[],
                   help="also time the largest batch's decodes next to one prompt chunk of each of these sizes")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-rows", type=int, default=18)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    result = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
