"""Which of the kernel library's vector paths run on this host (each asks the loaded library
what it was built for); `library.available()` says whether it loaded at all."""
from __future__ import annotations

import functools
import time

import torch

from tessera.kernels.library import available, load


def bf16_matmuls() -> bool:
    """Whether the few-row AVX512-BF16 matrix kernels (int8_gemm_bf16,
    int4_gemm_bf16) run here; the others have portable paths and only need `available()`."""
    return available() is None and bool(load().tessera_avx512_bf16())


def int4_i8_matmuls() -> bool:
    """Whether the int8-activation int4 kernel (int4_gemm_i8: AVX512-VNNI dot products, VBMI byte
    permutes, bfloat16 out) runs here."""
    return available() is None and bool(load().tessera_int4_i8())


def avx2_matmuls() -> bool:
    """Whether the float32 AVX2 + FMA int4 kernel (int4_gemm_f32) runs here: hosts without
    AVX-512, where PyTorch's int4pack kernel is the slow path (see int4_avx2.c)."""
    return available() is None and bool(load().tessera_avx2_fma())


def int16_row_products() -> bool:
    """Whether float32 decode rows meet int8 weights as int16 (int8_gemv_i16: as fast as int8_gemv
    at one row on an AVX2 host, 1.7x at two, and a row's result the same in any step): builds for AVX2. AVX-512 builds keep int8_gemv, whose 16-lane float
    path was not measured against it."""
    from tessera.kernels import isa

    return available() is None and isa.selected().name == "avx2"


def kquant_matmuls() -> bool:
    """Whether the K-quant kernels' vector paths (AVX512-BW, AVX2, or NEON's dot products) run here
    (kquant_gemm.c): without them the native Q6_K / Q4_K storage would multiply in a plain C loop,
    so those tensors keep the int8 and int4 layouts."""
    return available() is None and bool(load().tessera_kquant_vector())


@functools.cache
def int8_products_fast() -> bool:
    """Whether PyTorch's int8 x int8 -> int32 product (torch._int_mm) runs at speed here. It calls
    oneDNN where the host has VNNI dot products (AVX512-VNNI, AVX-VNNI, AMX) and a plain loop
    elsewhere: on an AMD EPYC with AVX2 alone that loop made 1.8 G products a second against
    float32 sgemm's 25 GFLOP/s, and a 400-token prompt of the 1.5B took minutes. A capped run on
    a VNNI host keeps oneDNN's path, so the host is asked, not its flags: the same product timed
    both ways, once a process (~10 ms where the loop is slow)."""
    a = torch.randint(-8, 8, (64, 512), dtype=torch.int8)
    b = torch.randint(-8, 8, (512, 512), dtype=torch.int8)
    af, bf = a.float(), b.float()

    def best(fn) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(lambda: torch._int_mm(a, b)) <= 2.0 * best(lambda: af @ bf)
