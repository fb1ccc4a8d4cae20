"""Perplexity of each quantization method against the dequantized (dense float32) model.

    python benchmarks/perplexity.py --models smollm2-135m qwen2.5-coder-0.5b \\
        --out benchmarks/results/perplexity.json

The text is tests/data/gfdl-1.3-head.txt (the GNU FDL 1.3's opening, ~2,500 tokens), cut to
--tokens tokens and scored in one forward pass (prefill-sized, so quantized layers multiply by
their dequantized weights: the weights' values are what is compared here; the kernels' agreement
is tests/test_quantization.py's job).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "gfdl-1.3-head.txt"


def perplexity(loaded, ids: list[int]) -> float:
    from tessera.models.loader import forward_single

    with torch.inference_mode():
        logits = forward_single(loaded, ids)
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
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    results = []
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
