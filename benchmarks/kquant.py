"""A model's linear layers as one decode or verification step runs them, with the K-quant kernels
(Q6_K and Q4_K at the file's width, int8 activations) and without (int8 groups and int4 tiles,
bfloat16 activations).

The model is loaded twice in bfloat16 with `--quantization auto`, `int8_activations` on and
off; every Linear of the model (the LM head included) multiplies `rows` random activation rows,
in the model's order, as a step reads the weights (from memory: a pass streams the whole model).
Medians of 7 passes, milliseconds per pass (and per pass over each method's layers alone), and
the stored bytes a pass reads, by method.

    python benchmarks/kquant.py --model qwen2.5-coder-1.5b --out benchmarks/results/kquant/qwen1.5b.json
"""
from __future__ import annotations

import argparse
import json
import platform
from collections import Counter
from pathlib import Path

import torch

from tessera.bench.machine import median_ms
from tessera.hostinfo import cpu_model_name


def linears(model: torch.nn.Module) -> list:
    from tessera.layers import Linear

    return [m for m in model.modules() if isinstance(m, Linear) and m.quant_method is not None]


def stored_bytes(layers) -> dict[str, int]:
    by: Counter = Counter()
    for m in layers:
        by[m.quant_method.name] += m.quant_method.nbytes(m)
    return dict(by)


def time_pass(layers, rows: int) -> float:
    xs = {}
    for m in layers:
        k = m.input_size
        if k not in xs:
            xs[k] = torch.randn(rows, k).bfloat16()

    def one_pass() -> None:
        for m in layers:
            m.quant_method.apply(m, xs[m.input_size])

    with torch.inference_mode():
        return median_ms(one_pass)


def main() -> None:
    from tessera.models.loader import load_model
    from tessera.models.registry import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    path = resolve_model(args.model)
    settings = {}
    for int8 in (False, True):
        loaded = load_model(path, "bfloat16", int8_activations=int8, weight_cache=True)
        settings[int8] = (loaded, linears(loaded.model))
    results = []
    for rows in args.rows:
        r = {"rows": rows}
        for int8 in (False, True):  # alternate the two within each row count
            r["int8_activations_ms" if int8 else "bf16_activations_ms"] = round(time_pass(settings[int8][1], rows), 2)
        r["speedup"] = round(r["bf16_activations_ms"] / r["int8_activations_ms"], 3)
        for int8 in (False, True):  # the same pass over each method's layers alone
            layers = settings[int8][1]
            for name in sorted({m.quant_method.name for m in layers}):
                part = [m for m in layers if m.quant_method.name == name]
                r[f"{'int8' if int8 else 'bf16'}_activations_{name}_ms"] = round(time_pass(part, rows), 2)
        results.append(r)
        print(r, flush=True)
    stored = {("int8_activations" if k else "bf16_activations"): stored_bytes(v[1]) for k, v in settings.items()}
    print(stored)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"host": cpu_model_name(), "machine": platform.machine(),
                                        "threads": torch.get_num_threads(), "model": args.model,
                                        "stored_bytes_by_method": stored, "ms_per_pass": results}, indent=1))


if __name__ == "__main__":
    main()
