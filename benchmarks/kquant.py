"""A model's linear layers as one decode or verification step runs them, with the K-quant kernels
(Q6_K and Q4_K at the file's width, int8 activations) and without (int8 groups and int4 tiles,
bfloat16 activations).

The model is loaded twice in bfloat16 with `--quantization auto`, `int8_activations` on and
off; every Linear of the model (the LM head included) multiplies `rows` random activation rows,
in the model's order, as a step reads the weights (from memory: a pass streams the whole model).
Medians of 7 passes, milliseconds per pass (and per pass over each method's layers alone), and
the stored bytes a pass reads, by method.

`--prefill` instead times prefill-sized steps (64-512 rows) with the K-quant layers both ways
large steps can go: the weight dequantized to bfloat16 for the call and multiplied by oneDNN, or
requantized to int8 per row and multiplied as int8 x int8 (torch._int_mm); the better of two
alternated medians of 3 passes each. `--sliced` times, in float32, the two routes of a host whose
PyTorch int8 product is a plain loop (capabilities.int8_products_fast): the kernels in slices of
8 rows against the int8 rows widened to float32 for sgemm (kquant.SLICED_MAX_ROWS picks between them).

    python benchmarks/kquant.py --model qwen2.5-coder-1.5b --out benchmarks/results/kquant/qwen1.5b.json
    python benchmarks/kquant.py --model qwen2.5-coder-1.5b --prefill --rows 64 128 256 512 --out benchmarks/results/kquant/prefill.json
    python benchmarks/kquant.py --model qwen2.5-coder-1.5b --sliced --rows 16 33 64 128 256 512 --out benchmarks/results/kquant/sliced_avx2.json
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
    """The layers a step multiplies: every Linear but an embedding table that is only looked up
    (one tied to the LM head counts, as the head)."""
    from tessera.layers import Linear
    from tessera.layers.linear import VocabEmbedding

    head = getattr(model, "lm_head", None)
    return [m for m in model.modules() if isinstance(m, Linear) and m.quant_method is not None
            and (m is head or not isinstance(m, VocabEmbedding))]


def stored_bytes(layers) -> dict[str, int]:
    by: Counter = Counter()
    for m in layers:
        by[m.quant_method.name] += m.quant_method.nbytes(m)
    return dict(by)


def time_pass(layers, rows: int, repeats: int = 7, product=None, dtype=torch.bfloat16) -> float:
    """Median ms of one pass over `layers` at `rows` rows of `dtype`; `product(m, x)` multiplies
    (default: the layer's own method, as a step does)."""
    product = product or (lambda m, x: m.quant_method.apply(m, x))
    xs = {}
    for m in layers:
        k = m.input_size
        if k not in xs:
            xs[k] = torch.randn(rows, k).to(dtype)

    def one_pass() -> None:
        for m in layers:
            product(m, xs[m.input_size])

    with torch.inference_mode():
        return median_ms(one_pass, repeats)


def _bf16_product(m, x):
    """The route int8 products replaced: the weight dequantized to bfloat16 for the call, in the
    model's workspace, then a oneDNN bfloat16 product."""
    from tessera.kernels import gguf_ops
    from tessera.layers.quantization import dense_linear

    q = m.quant_method
    n, k = m.d.shape[0], m.scales.shape[1] * 16
    out = q.config.workspace.get("weight", (n, k), torch.bfloat16)
    w = gguf_ops.kquant_dequant_bf16(q.name, m.qweight, m.scales, m.d, k, out)
    return dense_linear(x, w)


def compare_prefill(layers, rows_list: list[int]) -> list[dict]:
    """The K-quant layers' large steps, bfloat16 against int8 x int8, at each row count."""
    kq = [m for m in layers if m.quant_method.name in ("q4_k", "q6_k")]
    routes = {"bf16": _bf16_product, "int8": lambda m, x: m.quant_method._int8_matmul(m, x)}
    results = []
    for rows in rows_list:
        r: dict = {"rows": rows}
        for route in ("bf16", "int8", "bf16", "int8"):  # alternated; each pass a median of 3
            r.setdefault(f"{route}_ms", []).append(round(time_pass(kq, rows, 3, routes[route]), 1))
        r = {**r, **{k: min(v) for k, v in r.items() if k != "rows"}}
        r["speedup"] = round(r["bf16_ms"] / r["int8_ms"], 3)
        r["int8_tokens_per_s_linears"] = round(rows / r["int8_ms"] * 1000, 1)
        results.append(r)
        print(r, flush=True)
    return results


def _f32_product(m, x):
    """The float32 route of a host without a fast int8 product: the weight requantized to int8
    rows for the call, widened to float32 a slice at a time for sgemm."""
    from tessera.kernels import gguf_ops

    q = m.quant_method
    n, k = m.d.shape[0], m.scales.shape[1] * 16
    wq, rs = gguf_ops.kquant_dequant_int8(q.name, m.qweight, m.scales, m.d, k,
                                          q.config.workspace.get("weight", (n, k), torch.int8))
    return gguf_ops.int8_weight_matmul_f32(x, wq, rs)


def compare_sliced(layers, rows_list: list[int]) -> list[dict]:
    """The K-quant layers in float32, the kernels in slices of 8 rows against float32 sgemm."""
    kq = [m for m in layers if m.quant_method.name in ("q4_k", "q6_k")]
    routes = {"sliced": lambda m, x: m.quant_method._small(m, x), "float32": _f32_product}
    results = []
    for rows in rows_list:
        r: dict = {"rows": rows}
        for route in ("sliced", "float32", "sliced", "float32"):  # alternated; each pass a median of 3
            r.setdefault(f"{route}_ms", []).append(round(time_pass(kq, rows, 3, routes[route], torch.float32), 1))
        r = {**r, **{k: min(v) for k, v in r.items() if k != "rows"}}
        r["float32_over_sliced"] = round(r["float32_ms"] / r["sliced_ms"], 3)
        results.append(r)
        print(r, flush=True)
    return results


def main() -> None:
    from tessera.models.loader import load_model
    from tessera.models.registry import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8])
    ap.add_argument("--prefill", action="store_true", help="large steps: bfloat16 against int8 x int8")
    ap.add_argument("--sliced", action="store_true", help="float32 steps: kernel slices against float32 sgemm")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    path = resolve_model(args.model)
    if args.sliced or args.prefill:
        from tessera.kernels import capabilities

        dtype = "float32" if args.sliced else "bfloat16"
        layers = linears(load_model(path, dtype, weight_cache=True).model)
        found = ({"int8_products_fast": capabilities.int8_products_fast(), "sliced": compare_sliced(layers, args.rows)}
                 if args.sliced else {"prefill": compare_prefill(layers, args.rows)})
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"host": cpu_model_name(), "machine": platform.machine(),
                                            "threads": torch.get_num_threads(), "model": args.model, **found},
                                           indent=1))
        return
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
