"""Perplexity of each quantization method against the dequantized (dense float32) model, or of
int8 activations against bfloat16 activations on the same weights.

    python benchmarks/perplexity.py --models smollm2-135m qwen2.5-coder-0.5b \\
        --out benchmarks/results/perplexity.json
    python benchmarks/perplexity.py --activations --chunk 8 \\
        --models smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b gemma3-270m \\
        --out benchmarks/results/perplexity/int8_activations.json

The text is tests/data/gfdl-1.3-head.txt (the GNU FDL 1.3's opening, ~2,500 tokens), cut to
--tokens tokens and scored in one forward pass (prefill-sized, so quantized layers multiply by
their dequantized weights: the weights' values are what is compared here; the kernels' agreement
is tests/layers/test_quantization.py's job).

`--activations` loads each model twice in bfloat16 with `--quantization auto`, with and without
int8 activations (Q6_K and Q4_K tensors through kquant_gemm.c against int8 groups and int4 tiles
times bfloat16 activations: the same weight values, except that int4 tiles hold Q4_K's scales and
zeros in bfloat16), and scores the text `--chunk` tokens a pass over the KV
cache: `--chunk 8`, the row counts of decode and verification steps, the ones that take the
few-row kernels; `--chunk 512`, prompt chunks, which multiply K-quant weights as int8 x int8.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "gfdl-1.3-head.txt"


def perplexity(loaded, ids: list[int], chunk=None) -> float:
    from tessera.models.loader import forward_single

    with torch.inference_mode():
        logits = forward_single(loaded, ids, chunk=chunk)
    lp = torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1))
    return math.exp(-lp.mean().item())


def main() -> None:
    from tessera.models.loader import load_model
    from tessera.models.registry import resolve_model
    from tessera.models.weights import describe_quantization

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    p.add_argument("--methods", nargs="+", default=["auto", "int8", "int4"])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--activations", action="store_true",
                   help="int8 against bfloat16 activations, same weights (bfloat16, --quantization auto)")
    p.add_argument("--chunk", type=int, default=None, help="tokens a forward pass (default: all at once)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    results = []
    if args.activations:
        for name in args.models:
            path = resolve_model(name)
            ppl = {}
            for int8 in (False, True):
                loaded = load_model(path, "bfloat16", int8_activations=int8)
                ids = loaded.tokenizer.encode(TEXT.read_text())[:args.tokens]
                ppl[int8] = perplexity(loaded, ids, args.chunk)
                weights = describe_quantization(loaded.model)
                del loaded
            row = {"model": name, "tokens": len(ids), "chunk": args.chunk, "ppl_bf16_activations": ppl[False],
                   "ppl_int8_activations": ppl[True], "ratio": ppl[True] / ppl[False], "weights": weights}
            results.append(row)
            print(f"{name:22s} bf16 activations ppl {ppl[False]:8.4f}, int8 {ppl[True]:8.4f}: "
                  f"{100 * (row['ratio'] - 1):+.3f} %", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))
        return
    for name in args.models:
        path = resolve_model(name)
        ref = load_model(path, "float32", quantization="none")
        ids = ref.tokenizer.encode(TEXT.read_text())[:args.tokens]
        base = perplexity(ref, ids)
        del ref
        for method in args.methods:
            loaded = load_model(path, "float32", quantization=method)
            ppl = perplexity(loaded, ids)
            row = {"model": name, "quantization": method, "tokens": len(ids), "ppl_dense": base, "ppl": ppl,
                   "ratio": ppl / base, "weights": describe_quantization(loaded.model)}
            results.append(row)
            print(f"{name:22s} {method:5s} ppl {ppl:8.4f} vs dense {base:8.4f}: {100 * (ppl / base - 1):+.2f} %",
                  flush=True)
            del loaded
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
