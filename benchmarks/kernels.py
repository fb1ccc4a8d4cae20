"""Weight-only matmul kernels against the dense bfloat16 matmul, by row count, as a model step sees them.

A step reads every layer's weights once, so they come from memory, not from a cache kept
hot by repeating one matrix: this times the four matrices of each of a model's layers
(smollm2-135m's shapes by default: 30 x qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536) in sequence, for each row count, with
- dense: dense_linear on the bfloat16 weights (what the dense copy gives prefill-sized steps),
- torch_int4: torch._weight_int4pack_mm_for_cpu on the int4pack layout,
- int4_gemm: Tessera's few-row kernel (tessera/kernels/int4_gemv.c) on the same layout,
- int4_i8: the int8-activation kernel (int4_gemm_i8, AVX512-VNNI) on the same layout.
Medians of 7 passes, milliseconds per pass over the whole model.

    python benchmarks/kernels.py --out benchmarks/results/int4_gemm.json
    python benchmarks/kernels.py --kinds dense int4_gemm int4_i8 --rows 1 2 4 8 16 32 64 128 256 512 \
        --out benchmarks/results/int4_i8/kernels.json
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from tessera.kernels import library, matmul_ops
from tessera.bench.machine import machine_info, median_ms
from tessera.layers.quantization import dense_linear, quantize_int4

SMOLLM2_LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def build(layers: int) -> list[list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = []
    for _ in range(layers):
        mats = []
        for n, k in SMOLLM2_LAYER:
            codes, scale, zero = quantize_int4(torch.randn(n, k) * 0.02)
            packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
            sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
            dense = ((codes.view(n, -1, 32).float() - 8) * scale[..., None] + zero[..., None]).view(n, k)
            mats.append((n, k, packed, sz, dense.to(torch.bfloat16)))
        model.append(mats)
    return model


def time_pass(model, rows: int, how: str) -> float:
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {k for _, k in SMOLLM2_LAYER}}

    def one_pass() -> None:
        for mats in model:
            for n, k, packed, sz, dense in mats:
                if how == "dense":
                    dense_linear(xs[k], dense)
                elif how == "torch_int4":
                    torch._weight_int4pack_mm_for_cpu(xs[k], packed, 32, sz)
                elif how == "int4_i8":
                    matmul_ops.int4_gemm_i8(xs[k], packed, sz, n)
                else:
                    matmul_ops.int4_gemm_bf16(xs[k], packed, sz, n)

    return median_ms(one_pass)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--kinds", nargs="+", default=["dense", "torch_int4", "int4_gemm"],
                    choices=["dense", "torch_int4", "int4_gemm", "int4_i8"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if library.available() is not None:
        raise SystemExit(f"kernels unavailable: {library.available()}")
    model = build(args.layers)
    rows = []
    for m in args.rows:
        r = {"rows": m, **{how: round(time_pass(model, m, how), 3) for how in args.kinds}}
        for how in ("int4_gemm", "int4_i8"):
            if how in r and "dense" in r:
                r[f"{how}_speedup_vs_dense"] = round(r["dense"] / r[how], 2)
        if "int4_gemm" in r and "int4_i8" in r:
            r["int4_i8_speedup_vs_int4_gemm"] = round(r["int4_gemm"] / r["int4_i8"], 2)
        rows.append(r)
        print(r)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "host": machine_info(),
                                        "threads": torch.get_num_threads(), "layers": args.layers,
                                        "shapes": SMOLLM2_LAYER, "ms_per_model_pass": rows}, indent=1))


if __name__ == "__main__":
    main()
