"""Grouped int8 weights (the checkpoint's scale per 16 or 32 values) against per-row int8, as a
decode or verification step of qwen2.5-coder-0.5b reads them.

Per-row int8 (one scale per output row) was how Tessera stored GGUF's 5- to 8-bit tensors
before: a second rounding of every weight. The grouped layout keeps the file's codes and
scales, reading 1/8 (groups of 32) or 1/4 (groups of 16, Q6_K) more bytes. This times, over
the model's 24 layers of qkv 1152x896, o 896x896, gate_up 9728x896 (Q5_0: groups of 32) and
down 896x4864 (Q6_K: groups of 16) plus the 151936x896 LM head (Q8_0), in bfloat16:
- per_row_torch: torch._weight_int8pack_mm (per-row scales),
- per_row_kernel: the previous per-row kernels (int8_gemv.c at `--before`, a git revision,
  compiled here), the 1-2 row streaming loop and the 3-8 row AVX512-BF16 one,
- grouped: tessera.kernels.matmul_ops.int8_gemv / int8_gemm_bf16 on the grouped layout.
Medians of 7 passes, milliseconds per pass over the whole model.

    python benchmarks/int8_groups.py --before 97e3d4f --out benchmarks/results/int8_groups.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from tessera.kernels import library, matmul_ops
from tessera.bench.machine import median_ms
from tessera.hostinfo import cpu_model_name

LAYER = [(1152, 896, 32), (896, 896, 32), (9728, 896, 32), (896, 4864, 16)]
HEAD = (151936, 896, 32)


def old_library(rev: str) -> ctypes.CDLL:
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True).stdout.strip())
    tmp = Path(tempfile.mkdtemp())
    for name in ("int8_gemv.c", *library.HEADERS):  # the headers `rev` has
        shown = subprocess.run(["git", "show", f"{rev}:tessera/kernels/{name}"], cwd=root, capture_output=True,
                               text=True, check=name == "int8_gemv.c")
        if shown.returncode == 0:
            (tmp / name).write_text(shown.stdout)
    subprocess.run(["cc", *library.CFLAGS, str(tmp / "int8_gemv.c"), "-o", str(tmp / "old.so"), "-lm"], check=True)
    lib = ctypes.CDLL(str(tmp / "old.so"))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.int8_gemv.argtypes = [p, p, p, p, i64, i64, i64, ctypes.c_int, p]
    lib.int8_gemm_bf16.argtypes = [p, p, p, p, i64, i64, i64]
    return lib


def build(layers: int) -> list[tuple[int, int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    mats = []
    for n, k, g in LAYER * layers + [HEAD]:
        codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        mats.append((n, k, g, codes, torch.rand(n) * 1e-3, torch.rand(n, k // g) * 1e-3,
                     (torch.rand(n) * 1e-3).bfloat16()))
    return mats


def time_pass(mats, rows: int, how: str, old) -> float:
    xs = {k: torch.randn(rows, k).bfloat16() for k in {m[1] for m in mats}}

    def one_pass() -> None:
        for n, k, g, codes, row_scale, group_scale, row_scale_bf16 in mats:
            x = xs[k]
            if how == "per_row_torch":
                torch._weight_int8pack_mm(x, codes, row_scale_bf16)
            elif how == "per_row_kernel":
                out = torch.empty(rows, n, dtype=torch.bfloat16)
                if rows <= 2:
                    scratch = torch.empty(rows * k)
                    old.int8_gemv(x.data_ptr(), codes.data_ptr(), row_scale.data_ptr(), out.data_ptr(), rows, n, k,
                                  1, scratch.data_ptr())
                else:
                    old.int8_gemm_bf16(x.data_ptr(), codes.data_ptr(), row_scale.data_ptr(), out.data_ptr(), rows,
                                       n, k)
            elif rows <= 2:
                matmul_ops.int8_gemv(x, codes, group_scale)
            else:
                matmul_ops.int8_gemm_bf16(x, codes, group_scale)

    return median_ms(one_pass)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8])
    ap.add_argument("--before", default="97e3d4f", help="git revision whose per-row kernels to compare with")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if library.available() is not None:
        raise SystemExit(f"kernels unavailable: {library.available()}")
    old = old_library(args.before)
    mats = build(args.layers)
    results = []
    for m in args.rows:
        r = {"rows": m, **{how: round(time_pass(mats, m, how, old), 2)
                           for how in ("per_row_torch", "per_row_kernel", "grouped")}}
        r["grouped_vs_per_row_kernel"] = round(r["per_row_kernel"] / r["grouped"], 3)
        results.append(r)
        print(r)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"host": cpu_model_name(), "machine": platform.machine(),
                                        "threads": torch.get_num_threads(), "layers": args.layers,
                                        "shapes": LAYER, "head": HEAD, "ms_per_model_pass": results}, indent=1))


if __name__ == "__main__":
    main()
