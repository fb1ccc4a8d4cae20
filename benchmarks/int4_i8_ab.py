"""The int4 x int8-activation kernel (int4_gemm_i8) of this tree against another revision's, in
one process, on SmolLM2-135M's int4 projection shapes (qkv 960 x 576, o 576 x 576, gate_up
3072 x 576; random codes in PyTorch's int4pack layout), as a step of M rows runs them in its
30 layers.

As in kquant_ab.py: a few per cent is invisible between two runs on a 2-vCPU host, so both builds
run the same inputs in turn, alternating which goes first, and the medians are compared; their
outputs are also compared bit for bit.

    python benchmarks/int4_i8_ab.py --base HEAD~1 --out benchmarks/results/prefill_attention/int4_i8_ab.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kquant_ab import build_revision

SHAPES = ((960, 576), (576, 576), (3072, 576))
LAYERS = 30


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.int4_gemm_i8.argtypes = [p, p, p, p, i64, i64, i64, i64, p]
    lib.int4_gemm_i8.restype = ctypes.c_int
    lib.int4_i8_scratch_bytes.argtypes = [i64, i64]
    lib.int4_i8_scratch_bytes.restype = i64
    return lib


def matrices() -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n, k in SHAPES:
        n_pad = n + (-n % 64)
        codes = torch.randint(0, 16, (n_pad, k), dtype=torch.int32, generator=g)
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        sz = torch.stack([torch.rand(n_pad, k // 32, generator=g) * 0.02, torch.randn(n_pad, k // 32, generator=g) * 0.02],
                         -1).transpose(0, 1).contiguous().bfloat16()
        out.append((n, k, n_pad, packed, sz))
    return out


def one_pass(lib: ctypes.CDLL, mats: list, x: torch.Tensor, outs: list, scratch: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(LAYERS):
        for (n, k, n_pad, packed, sz), out in zip(mats, outs):
            lib.int4_gemm_i8(x.data_ptr(), packed.data_ptr(), sz.data_ptr(), out.data_ptr(), x.shape[0], n_pad, n, k,
                             scratch.data_ptr())
    return time.perf_counter() - start


def main() -> None:
    from tessera.kernels import library
    from tessera.bench.machine import machine_info

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="git revision to compare against")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 1024])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    base = bind(build_revision(args.base, Path(tempfile.mkdtemp())))
    this = bind(library.load())
    mats = matrices()
    rows = []
    for m in args.rows:
        x = torch.randn(m, SHAPES[0][1], generator=torch.Generator().manual_seed(m)).bfloat16()
        outs = {lib: [torch.empty(m, n, dtype=torch.bfloat16) for n, *_ in mats] for lib in ("base", "this")}
        scratch = torch.empty(this.int4_i8_scratch_bytes(m, SHAPES[0][1]), dtype=torch.uint8)
        times = {"base": [], "this": []}
        libs = {"base": base, "this": this}
        for i in range(args.repeats + 1):
            for name in (("base", "this") if i % 2 else ("this", "base")):
                t = one_pass(libs[name], mats, x, outs[name], scratch)
                if i:  # the first pass of each warms up
                    times[name].append(t)
        same = all(torch.equal(a, b) for a, b in zip(outs["base"], outs["this"]))
        row = {"rows": m, "base_ms": statistics.median(times["base"]) * 1e3,
               "this_ms": statistics.median(times["this"]) * 1e3, "identical": same}
        row["speedup"] = row["base_ms"] / row["this_ms"]
        rows.append(row)
        print(f"{m:5d} rows: {args.base} {row['base_ms']:.1f} ms, this tree {row['this_ms']:.1f} ms: "
              f"{row['speedup']:.2f}x, outputs identical: {same}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"base": args.base, "rows": rows, "machine": machine_info()}, indent=1))


if __name__ == "__main__":
    main()
