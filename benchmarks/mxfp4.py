"""The MXFP4 kernel (tessera/kernels/mxfp4_gemm.c: the file's blocks, int8 activations) against a
dense float32 matmul of the same matrix, at gpt-oss-20b's expert shapes: down 2880x2880 and
gate_up 5760x2880 ([out, in]), random codes and exponents 118..130.

Per row count: `kernel` (mxfp4_gemm, up to MXFP4_MAX_ROWS rows), `dense` (x @ W.T with W already
float32), `dequant` (mxfp4_dequant into a kept buffer: what a large step adds before its dense
product) and `method` (MXFP4Method.apply: the kernel up to MXFP4_KERNEL_MAX_ROWS, then dequant +
dense). Medians of `--repeats` calls after a warm-up, milliseconds; the matrices are one copy each,
so the MXFP4 blocks (4.4 / 8.8 MB) may sit in the last-level cache while the dense ones (33 / 66
MB) stream from memory, as a model's much larger set would.

    python benchmarks/mxfp4.py --threads 1 --out benchmarks/results/mxfp4/avx2_epyc_1thread.json
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tessera.kernels import bindings, gguf_ops, library
from tessera.bench.machine import median_ms
from tessera.hostinfo import cpu_model_name

SHAPES = [(2880, 2880), (5760, 2880)]


def lscpu_model_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")


def mxfp4_blocks(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(118, 131, (n, k // 32))
    return raw.reshape(n, -1)


def main() -> None:
    from gguf import GGMLQuantizationType

    from tessera.layers import GGUFWeight, QuantConfig
    from tessera.layers.quantization import MXFP4Method

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, help="torch's (and so the kernels') threads; default: torch's")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if library.available() is not None:
        raise SystemExit(f"kernels unavailable: {library.available()}")
    results = []
    for n, k in SHAPES:
        raw = mxfp4_blocks(n, k)
        blocks = torch.from_numpy(raw)
        dense = gguf_ops.mxfp4_dequant(blocks, k, torch.float32)
        method = MXFP4Method(QuantConfig("auto", torch.float32))
        layer = nn.Module()
        method.load(layer, [GGUFWeight(raw, GGMLQuantizationType.MXFP4, (n, k))])
        for m in args.rows:
            x = torch.randn(m, k)
            r = {"shape": [n, k], "rows": m,
                 "dense_ms": round(median_ms(lambda: x @ dense.T, args.repeats), 3),
                 "dequant_ms": round(median_ms(lambda: gguf_ops.mxfp4_dequant(blocks, k, torch.float32, dense),
                                               args.repeats), 3),
                 "method_ms": round(median_ms(lambda: method.apply(layer, x), args.repeats), 3)}
            if m <= bindings.MXFP4_MAX_ROWS:
                r["kernel_ms"] = round(median_ms(lambda: gguf_ops.mxfp4_gemm(x, blocks), args.repeats), 3)
                r["dense_over_kernel"] = round(r["dense_ms"] / r["kernel_ms"], 2)
            results.append(r)
            print(r)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"host": cpu_model_name(), "lscpu_model_name": lscpu_model_name(), "machine": platform.machine(),
                                        "threads": torch.get_num_threads(), "ms": results}, indent=1))


if __name__ == "__main__":
    main()
