"""The K-quant kernels (q4k_gemm, q6k_gemm) of this tree against those of another git revision,
on a model's own Q4_K/Q6_K matrices, in one process.

A kernel change worth a few percent is invisible between two runs on a shared 2-vCPU host, whose
speed drifts by more than that from minute to minute. Here both builds multiply the same
weights in turn, alternating which goes first each repeat, and the medians are compared:
one pass runs every K-quant layer of the model (LM head included) on `rows` random activation
rows, as a decode (1 row) or a verification / small-batch step (2-8) reads them from memory.

    python benchmarks/kquant_ab.py --base HEAD~1 --model qwen2.5-coder-1.5b --out benchmarks/results/kquant_c_step/kquant_ab.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch


def build_revision(rev: str, out_dir: Path) -> ctypes.CDLL:
    """The kernel library compiled from `rev`'s sources (tessera/kernels) as the variant this process
    runs (TESSERA_CPU_ISA's, else the host's best), with this tree's flags."""
    from tessera.kernels import isa, library

    src = out_dir / "src"
    src.mkdir(parents=True, exist_ok=True)
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip()
    for name in library.SOURCES + library.HEADERS:
        text = subprocess.run(["git", "-C", root, "show", f"{rev}:tessera/kernels/{name}"], capture_output=True,
                              text=True)
        if text.returncode == 0:
            (src / name).write_text(text.stdout)
    return _bind(ctypes.CDLL(str(library.build(isa.selected(), source_dir=src))))


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for f in (lib.q4k_gemm, lib.q6k_gemm):
        f.argtypes = [p, p, p, p, p, i64, i64, i64, ctypes.c_int, p]
        f.restype = ctypes.c_int
    lib.kquant_scratch_bytes.argtypes = [i64, i64]
    lib.kquant_scratch_bytes.restype = i64
    return lib


def one_pass(lib: ctypes.CDLL, layers: list, xs: dict, outs: dict) -> float:
    """Seconds for every K-quant layer's product of its rows, through `lib`."""
    start = time.perf_counter()
    for name, kind, layer in layers:
        x = xs[layer.scales.shape[1] * 16]
        m, k = x.shape
        n = layer.d.shape[0]
        # buffers made on the warm-up pass, not in the timed ones
        skey, okey = ("scratch", id(lib), m, k), (name, m)
        if skey not in outs:
            outs[skey] = torch.empty(lib.kquant_scratch_bytes(m, k), dtype=torch.uint8)
        if okey not in outs:
            outs[okey] = torch.empty(m, n, dtype=x.dtype)
        scratch, out = outs[skey], outs[okey]
        fn = lib.q4k_gemm if kind == "q4_k" else lib.q6k_gemm
        if fn(x.data_ptr(), layer.qweight.data_ptr(), layer.scales.data_ptr(), layer.d.data_ptr(), out.data_ptr(),
              m, n, k, int(x.dtype == torch.bfloat16), scratch.data_ptr()) != 0:
            raise RuntimeError(f"{name}: the kernel refused {m} x {k}")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD~1", help="git revision whose kernels are the baseline")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8])
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from tessera import LLM
    from tessera.kernels import library
    from tessera.bench.machine import machine_info
    from tessera.layers import Linear
    from tessera.layers.quantization import KQuantMethod
    from tessera.models.dtype import resolve_dtype

    llm = LLM(args.model, max_num_seqs=1, enable_prefix_caching=False)
    layers = [(name, m.quant_method.name, m) for name, m in llm.engine.runner.model.named_modules()
              if isinstance(m, Linear) and isinstance(m.quant_method, KQuantMethod)]
    if not layers:
        raise SystemExit(f"{args.model} has no Q4_K/Q6_K layers here (bfloat16 and --int8-activations needed)")
    # the activations' dtype --dtype auto gives at this level (float32 below avx512_bf16)
    dtype = resolve_dtype("auto", llm.engine.runner.model.config)
    libs = {"this tree": _bind(library.load())}
    with tempfile.TemporaryDirectory() as tmp:
        libs[args.base] = build_revision(args.base, Path(tmp))
        rows_out = []
        for m in args.rows:
            torch.manual_seed(m)
            xs = {k: torch.randn(m, k).to(dtype) for k in {layer.scales.shape[1] * 16 for _, _, layer in layers}}
            outs: dict = {}
            times: dict[str, list[float]] = {name: [] for name in libs}
            order = list(libs)
            for r in range(args.repeats + 1):
                for name in (order if r % 2 == 0 else order[::-1]):
                    t = one_pass(libs[name], layers, xs, outs)
                    if r:  # the first round warms both
                        times[name].append(t)
            med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            row = {"rows": m, "median_ms": med, "min_ms": {n: min(ts) * 1e3 for n, ts in times.items()},
                   "speedup": med[args.base] / med["this tree"]}
            rows_out.append(row)
            print(f"{m} rows: {args.base} {med[args.base]:.2f} ms, this tree {med['this tree']:.2f} ms "
                  f"({row['speedup']:.3f}x)")
    byte_count = sum(sum(b.numel() * b.element_size() for b in layer.buffers(recurse=False)) for _, _, layer in layers)
    result = {"model": args.model, "base": args.base,
              "head": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "layers": len(layers), "bytes_per_pass": byte_count, "repeats": args.repeats, "results": rows_out,
              "machine": machine_info()}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
