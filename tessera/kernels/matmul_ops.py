"""Tensor wrappers of the few-row products over Tessera's own int8 and int4 layouts (int8_gemv.c,
int4_gemv.c, int4_avx2.c); `capabilities` says which of them run on this host."""
from __future__ import annotations

from typing import Optional

import torch

from tessera.kernels.bindings import INT4_F32_MAX_ROWS, INT8_GEMM_MAX_ROWS, INT8_GEMV_MAX_ROWS
from tessera.kernels.library import KernelUnavailable, load


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def int8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              zero: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (bfloat16 or float32, M <= 8) @ W.T -> [M, N] in x's dtype, where W [N, K] is the int8
    `weight` times float32 `scale` [N, K/G] (plus `zero` [N, K/G]) per group of G = K / (K/G)
    values, G a multiple of 16 (see int8_gemv.c)."""
    lib = load()
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty(m, weight.shape[0], dtype=x.dtype)
    scratch = torch.empty(m * k, dtype=torch.float32)
    if lib.int8_gemv(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), _ptr(zero), out.data_ptr(), m,
                     weight.shape[0], k, k // scale.shape[1], int(x.dtype == torch.bfloat16), scratch.data_ptr()) != 0:
        raise KernelUnavailable(f"int8_gemv takes at most {INT8_GEMV_MAX_ROWS} rows and groups of a multiple "
                                f"of 16 values (got {m} rows, groups of {k // scale.shape[1]})")
    return out


def int8_gemv_i16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  zero: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`int8_gemv` of float32 rows [M, K] (M <= 8), each rounded to int16 per 32 values on the way
    in (see int8_gemv.c): as fast at one row, 1.7x at two, within 1/65,534 of each group's largest
    value, and each row's result the same whatever rows are beside it."""
    lib = load()
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty(m, weight.shape[0], dtype=torch.float32)
    scratch = torch.empty(lib.int8_gemv_i16_scratch_bytes(m, k), dtype=torch.uint8)
    if x.dtype != torch.float32 or lib.int8_gemv_i16(
            x.data_ptr(), weight.data_ptr(), scale.data_ptr(), _ptr(zero), out.data_ptr(), m, weight.shape[0], k,
            k // scale.shape[1], scratch.data_ptr()) != 0:
        raise KernelUnavailable(f"int8_gemv_i16 takes 1-{INT8_GEMV_MAX_ROWS} float32 rows, K a multiple of 32 and "
                                f"groups of 16 or 32 (got {tuple(x.shape)} {x.dtype}, groups of {k // scale.shape[1]})")
    return out


def int8_gemm_bf16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   zero: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A few bfloat16 rows [M, K] (M <= INT8_GEMM_MAX_ROWS, K a multiple of 32) @ W.T -> [M, N]
    bfloat16, W as `int8_gemv` reads it (see int8_gemv.c)."""
    lib = load()
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty(m, weight.shape[0], dtype=torch.bfloat16)
    if lib.int8_gemm_bf16(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), _ptr(zero), out.data_ptr(), m,
                          weight.shape[0], k, k // scale.shape[1]) != 0:
        raise KernelUnavailable(f"int8_gemm_bf16 needs AVX-512 BF16, at most {INT8_GEMM_MAX_ROWS} rows and K "
                                f"a multiple of 32 (got {m} x {k})")
    return out


def int4_gemm_bf16(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, out_rows: int) -> torch.Tensor:
    """A few bfloat16 rows [M, K] times an int4pack weight (see int4_gemv.c) -> [M, out_rows] bfloat16."""
    lib = load()
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty(m, out_rows, dtype=torch.bfloat16)
    scratch = torch.empty(m * (k // 32), dtype=torch.float32)
    if lib.int4_gemm_bf16(x.data_ptr(), packed.data_ptr(), scales_zeros.data_ptr(), out.data_ptr(), m,
                          scales_zeros.shape[1], out_rows, k, scratch.data_ptr()) != 0:
        raise KernelUnavailable("int4_gemm_bf16 needs AVX-512 BF16 on the build machine")
    return out


def int4_gemm_i8(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, out_rows: int) -> torch.Tensor:
    """bfloat16 rows [M, K] times an int4pack weight -> [M, out_rows] bfloat16, the rows quantized to
    int8 per group of 32 on the way in (see int4_gemv.c): exact integer products of the codes."""
    return _int4_i8("int4_gemm_i8", x, packed, scales_zeros, out_rows, torch.bfloat16,
                    "int4_gemm_i8 needs AVX512-VNNI and VBMI on the build machine")


def _int4_i8(name: str, x: torch.Tensor, packed: torch.Tensor, scales_zeros: Optional[torch.Tensor], out_rows: int,
             dtype: torch.dtype, refusal: str) -> torch.Tensor:
    """The int8- (or int16-) activation int4 kernel `name` for rows of `dtype` (bfloat16: int4_gemv.c's,
    with `scales_zeros`; float32: int4_i8_f32.c's, whose `packed` holds them) -> [M, out_rows];
    `refusal` formatted with m and k when it refuses the shape."""
    lib = load()
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty(m, out_rows, dtype=dtype)
    scratch_bytes = (lib.int4_i8_scratch_bytes if dtype == torch.bfloat16 else
                     lib.int4_i16_f32_scratch_bytes if name == "int4_gemm_i16_f32" else lib.int4_i8_f32_scratch_bytes)
    scratch = torch.empty(scratch_bytes(m, k), dtype=torch.uint8)
    args = (x.data_ptr(), packed.data_ptr()) + (() if scales_zeros is None else (scales_zeros.data_ptr(),))
    n_pad = packed.shape[0] * 32 if scales_zeros is None else scales_zeros.shape[1]
    if getattr(lib, name)(*args, out.data_ptr(), m, n_pad, out_rows, k, scratch.data_ptr()) != 0:
        raise KernelUnavailable(refusal.format(m=m, k=k))
    return out


def int4_gemm_f32(x: torch.Tensor, packed: torch.Tensor, out_rows: int) -> torch.Tensor:
    """float32 rows [M, K] (M <= INT4_F32_MAX_ROWS) times an int4 weight in the float32 layout
    (`packed` [N_pad/32, K/32, 640] uint8: codes with their half scales and zeros, see
    int4_avx2.c) -> [M, out_rows] float32."""
    lib = load()
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty(m, out_rows, dtype=torch.float32)
    if lib.int4_gemm_f32(x.data_ptr(), packed.data_ptr(), out.data_ptr(), m, packed.shape[0] * 32, out_rows, k) != 0:
        raise KernelUnavailable(f"int4_gemm_f32 needs AVX2 + FMA, at most {INT4_F32_MAX_ROWS} rows and K a "
                                f"multiple of 32 (got {m} x {k})")
    return out


def int4_gemm_i16_f32(x: torch.Tensor, packed: torch.Tensor, out_rows: int) -> torch.Tensor:
    """As `int4_gemm_f32`, each row quantized to int16 per group of 32 on the way in (see
    int4_i8_f32.c): within 1/65,534 of a group's largest value, ~1.65x faster at one row; decode and
    verification steps (up to INT4_I16_MAX_ROWS rows) take it."""
    return _int4_i8("int4_gemm_i16_f32", x, packed, None, out_rows, torch.float32,
                    "int4_gemm_i16_f32 takes K a multiple of 32 (got {m} x {k})")


def int4_gemm_i8_f32(x: torch.Tensor, packed: torch.Tensor, out_rows: int) -> torch.Tensor:
    """As `int4_gemm_f32` for any number of rows, each quantized to int8 per group of 32 on the way in
    (see int4_i8_f32.c): exact integer products of the codes, a quarter of the float32 kernel's
    instructions a weight."""
    return _int4_i8("int4_gemm_i8_f32", x, packed, None, out_rows, torch.float32,
                    "int4_gemm_i8_f32 takes K a multiple of 32 (got {m} x {k})")
