"""The GPU check in one run: greedy tokens against transformers, then a throughput sweep beside
transformers' batched generate, on random-weight models of real shapes (no checkpoint travels to
a lent GPU machine: the model folder is written here, with the tests' small tokenizer).

    python benchmarks/gpu_check.py --out results.json                 # on a GPU: Qwen2-1.5B's shape
    python benchmarks/gpu_check.py --shape tiny --device cpu --attention-backend paged  # the script itself, here

What it measures (each figure in the JSON beside the machine it ran on):
- greedy: float32, Tessera's tokens and transformers' for 64 tokens of each prompt (equal or not);
  bfloat16, the share of positions where transformers' argmax over Tessera's own sequence
  (teacher-forced) is the token Tessera chose.
- sweep: prompts of 512 random ids, 128 output tokens (ignore_eos), all submitted at once at each
  concurrency; output tokens per second of the whole batch, and at concurrency 1 the inter-token
  latency (median step time after the first token). transformers' `generate` on the same batch
  (left-padded, min_new_tokens = max_new_tokens) is the in-run baseline.
- roofline: the weight bytes a decode step reads over the HBM bandwidth given (--hbm-gbps).
- leaks: every KV block back in the pool after the sweep.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tessera.hostinfo import cpu_model_name  # noqa: E402
from tessera.llm import LLM  # noqa: E402
from tessera.sampling_params import SamplingParams  # noqa: E402
from tiny_model import make_tiny_model  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936),
}
ARCH = {"tiny": "qwen2", "smollm2-135m": "llama", "qwen2-1.5b": "qwen2"}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def hf_model(folder: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


def greedy_check(folder: Path, args, vocab: int) -> dict:
    """float32: token-for-token equality; bfloat16: top-1 agreement along Tessera's sequence."""
    prompts = random_prompts(4, 24, vocab, seed=1)
    params = SamplingParams(max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True)
    out = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(folder), dtype=dtype, device=args.device, attention_backend=args.attention_backend,
                  max_model_len=256, kv_cache_memory=256 << 20)
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        model = hf_model(folder, getattr(torch, dtype), args.device)
        with torch.no_grad():
            if dtype == "float32":
                ref = []
                for p in prompts:
                    ids = torch.tensor([p], device=args.device)
                    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.greedy_tokens,
                                         min_new_tokens=args.greedy_tokens, do_sample=False)
                    ref.append(gen[0, len(p):].tolist())
                same = sum(a == b for a, b in zip(ours, ref))
                out["float32"] = {"prompts": len(prompts), "identical": same, "tokens": args.greedy_tokens}
            else:
                agree = total = 0
                for p, o in zip(prompts, ours):
                    ids = torch.tensor([p + o], device=args.device)
                    top1 = model(ids).logits[0, len(p) - 1:-1].argmax(-1).tolist()
                    agree += sum(a == b for a, b in zip(top1, o))
                    total += len(o)
                out["bfloat16"] = {"positions": total, "top1_agree": agree, "share": round(agree / total, 4)}
        del model
    return out


def tessera_sweep(folder: Path, args, vocab: int) -> tuple[list[dict], dict]:
    llm = LLM(str(folder), dtype="bfloat16", device=args.device, attention_backend=args.attention_backend,
              max_model_len=args.prompt_len + args.output_len + 16, max_num_seqs=max(args.concurrency),
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rows = []
    for c in args.concurrency:
        prompts = random_prompts(c, args.prompt_len, vocab, seed=100 + c)
        for i, p in enumerate(prompts):
            engine.add_request(f"c{c}-{i}", p, params)
        steps = []
        sync(args.device)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            s0 = time.perf_counter()
            engine.step()
            sync(args.device)
            steps.append(time.perf_counter() - s0)
        wall = time.perf_counter() - t0
        out_tokens = c * args.output_len
        row = {"concurrency": c, "output_tokens": out_tokens, "seconds": round(wall, 3),
               "output_tok_s": round(out_tokens / wall, 1), "steps": len(steps)}
        if c == 1:
            decode = steps[-(args.output_len - 1):]
            row["itl_p50_ms"] = round(statistics.median(decode) * 1e3, 3)
        rows.append(row)
        print(json.dumps({"tessera": row}), flush=True)
    kv = engine.kv
    leaks = {"free_blocks": kv.num_free_blocks, "num_blocks": kv.num_blocks}
    leaks["leaked"] = kv.num_blocks - kv.num_free_blocks - (1 if engine.parts.kv_groups.hybrid else 0)
    return rows, leaks


def hf_sweep(folder: Path, args, vocab: int) -> list[dict]:
    model = hf_model(folder, torch.bfloat16, args.device)
    rows = []
    for c in args.concurrency:
        prompts = torch.tensor(random_prompts(c, args.prompt_len, vocab, seed=100 + c), device=args.device)
        sync(args.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.output_len,
                           min_new_tokens=args.output_len, do_sample=False)
        sync(args.device)
        wall = time.perf_counter() - t0
        row = {"concurrency": c, "seconds": round(wall, 3), "output_tok_s": round(c * args.output_len / wall, 1)}
        rows.append(row)
        print(json.dumps({"transformers": row}), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, default="qwen2-1.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="memory bandwidth for the roofline (H200: 4,800)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["greedy", "sweep", "transformers"])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    report = {"shape": args.shape, "config": shape, "host": platform.node(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else cpu_model_name()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_model(Path(tmp) / args.shape, arch=ARCH[args.shape], shape=shape,
                                 max_positions=max(4096, args.prompt_len + args.output_len + 16), std=0.02)
        vocab = shape["vocab_size"]
        if "greedy" not in args.skip:
            report["greedy"] = greedy_check(folder, args, vocab)
            print(json.dumps({"greedy": report["greedy"]}), flush=True)
        if "sweep" not in args.skip:
            report["tessera"], report["kv_blocks"] = tessera_sweep(folder, args, vocab)
        if "transformers" not in args.skip:
            report["transformers"] = hf_sweep(folder, args, vocab)
    h, i, n, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv_dim = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    weights = (n * (2 * h * h + 2 * h * kv_dim + 3 * h * i) + v * h) * 2  # bf16 linears and the LM head
    report["roofline"] = {"weight_bytes": weights, "decode_step_floor_ms": round(weights / (args.hbm_gbps * 1e9) * 1e3, 3)}
    if "tessera" in report and "transformers" in report:
        report["vs_transformers"] = {r["concurrency"]: round(r["output_tok_s"] / t["output_tok_s"], 2)
                                     for r, t in zip(report["tessera"], report["transformers"])}
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in report if k not in ("config",)}, indent=1))


if __name__ == "__main__":
    main()
