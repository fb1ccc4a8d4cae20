"""Tensor wrappers of the kernels over GGUF's block formats as stored: the K-quant products and
dequantizations (kquant_gemm.c, kquant_dequant.c), int8 x int8 products of requantized weights
(`int8_matmul`), and MXFP4 (mxfp4_gemm.c)."""
from __future__ import annotations

from typing import Optional

import torch

from tessera.kernels.bindings import KQUANT_MAX_ROWS, MXFP4_MAX_ROWS
from tessera.kernels.library import KernelUnavailable, load


def _kquant(fn_name: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, floats: torch.Tensor,
            out_rows: int) -> torch.Tensor:
    lib = load()
    m, k = x.shape
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    x = x.contiguous()
    out = torch.empty(m, out_rows, dtype=x.dtype)
    scratch = torch.empty(lib.kquant_scratch_bytes(m, k), dtype=torch.uint8)
    if getattr(lib, fn_name)(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), floats.data_ptr(), out.data_ptr(), m,
                             out_rows, k, int(x.dtype == torch.bfloat16), scratch.data_ptr()) != 0:
        raise KernelUnavailable(f"{fn_name} takes 1-{KQUANT_MAX_ROWS} rows and K a multiple of 256 (got {m} x {k})")
    return out


def q6k_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bfloat16 or float32, M <= KQUANT_MAX_ROWS, K a multiple of 256) @ W.T -> [M, N] in
    x's dtype, W a Q6_K matrix as `GGUFWeight.q6k_blocks` lays it out; x is quantized to int8 per
    256 values on the way in (see kquant_gemm.c)."""
    return _kquant("q6k_gemm", x, codes, scales, d, d.shape[0])


def q4k_gemm(x: torch.Tensor, codes: torch.Tensor, scale_min: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """As `q6k_gemm` for a Q4_K matrix as `GGUFWeight.q4k_blocks` lays it out."""
    return _kquant("q4k_gemm", x, codes, scale_min, dm, dm.shape[0])


def kquant_dequant_bf16(kind: str, codes: torch.Tensor, scales: torch.Tensor, floats: torch.Tensor,
                        in_features: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense bfloat16 weight [N, K] of a `kind` ("q6_k" or "q4_k") matrix as q6k_gemm /
    q4k_gemm read it: the float32 values rounded once (see kquant_dequant.c); into `out` if given."""
    n = floats.shape[0]
    if out is None:
        out = torch.empty(n, in_features, dtype=torch.bfloat16)
    assert out.shape == (n, in_features) and out.dtype == torch.bfloat16 and out.is_contiguous()
    fn = load().q6k_dequant_bf16 if kind == "q6_k" else load().q4k_dequant_bf16
    fn(codes.data_ptr(), scales.data_ptr(), floats.data_ptr(), out.data_ptr(), n, in_features)
    return out


def kquant_dequant_int8(kind: str, codes: torch.Tensor, scales: torch.Tensor, floats: torch.Tensor,
                        in_features: int, out: Optional[torch.Tensor] = None,
                        columns: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight of a `kind` ("q6_k" or "q4_k") matrix, its columns times `columns` [K] float32 if
    given, requantized to int8 per row for int8 x int8 products: ([N, K] int8 (`out` if given),
    [N] float32 row scales), w * columns ~ q * scale (see kquant_dequant.c)."""
    n = floats.shape[0]
    if out is None:
        out = torch.empty(n, in_features, dtype=torch.int8)
    assert out.shape == (n, in_features) and out.dtype == torch.int8 and out.is_contiguous()
    row_scales = torch.empty(n, dtype=torch.float32)
    fn = load().q6k_dequant_int8 if kind == "q6_k" else load().q4k_dequant_int8
    col = None if columns is None else columns.float().contiguous()
    fn(codes.data_ptr(), scales.data_ptr(), floats.data_ptr(), None if col is None else col.data_ptr(), out.data_ptr(),
       row_scales.data_ptr(), n, in_features)
    return out, row_scales


def int8_matmul(x: torch.Tensor, wq: torch.Tensor, row_scales: torch.Tensor,
                acc: Optional[torch.Tensor] = None, columns: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (bfloat16 or float32) @ (wq [N, K] int8 * row_scales [N]).T -> [M, N] in x's dtype:
    x quantized to int8 per row, the product exact in int32 (torch._int_mm, oneDNN's VNNI
    kernels; into `acc` [M, N] int32 if given), scaled once in float32 (kquant_gemm.c's
    int8_quantize_rows, int8_scale_products). `columns` [K]: x's columns are divided by these
    before rounding (the weight's were multiplied by them: kquant_dequant_int8)."""
    lib = load()
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    x = x.contiguous()
    m, k = x.shape
    is_bf16 = int(x.dtype == torch.bfloat16)
    xq = torch.empty(m, k, dtype=torch.int8)
    token_scales = torch.empty(m, dtype=torch.float32)
    col = None if columns is None else columns.float().contiguous()
    lib.int8_quantize_rows(x.data_ptr(), is_bf16, None if col is None else col.data_ptr(), xq.data_ptr(),
                           token_scales.data_ptr(), m, k)
    acc = torch._int_mm(xq, wq.t(), out=acc) if acc is not None else torch._int_mm(xq, wq.t())
    out = torch.empty(m, wq.shape[0], dtype=x.dtype)
    lib.int8_scale_products(acc.data_ptr(), token_scales.data_ptr(), row_scales.data_ptr(), out.data_ptr(), is_bf16,
                            m, wq.shape[0])
    return out


def int8_weight_matmul_f32(x: torch.Tensor, wq: torch.Tensor, row_scales: torch.Tensor,
                           slice_bytes: int = 2 << 20) -> torch.Tensor:
    """x [M, K] @ (wq [N, K] int8 * row_scales [N]).T -> [M, N] float32 by float32 sgemm, for hosts
    where int8 x int8 products have no fast kernel (capabilities.int8_products_fast): the weight's
    rows are widened to float32 a cache-sized slice (`slice_bytes`) at a time, never as a whole
    float32 copy, and the activations are not rounded."""
    xf = x.float().contiguous()
    m, k = xf.shape
    n = wq.shape[0]
    out_t = torch.empty(n, m, dtype=torch.float32)
    step = max(16, slice_bytes // (4 * k))
    buf = torch.empty(min(step, n), k, dtype=torch.float32)
    for i in range(0, n, step):
        j = min(n, i + step)
        w = buf[:j - i]
        w.copy_(wq[i:j])
        torch.mm(w, xf.t(), out=out_t[i:j])
    out_t.mul_(row_scales.view(n, 1))
    return out_t.t().contiguous()


def mxfp4_gemm(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bfloat16 or float32, M <= MXFP4_MAX_ROWS, K a multiple of 32) @ W.T -> [M, N] in x's
    dtype, W an MXFP4 matrix as the GGUF file stores it (`blocks` [N, K/32 * 17] uint8); x is
    quantized to int8 per 32 values on the way in (see mxfp4_gemm.c)."""
    lib = load()
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    x = x.contiguous()
    m, k = x.shape
    n = blocks.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    scratch = torch.empty(lib.mxfp4_scratch_bytes(m, k), dtype=torch.uint8)
    if blocks.shape[1] * 32 != k * 17 or lib.mxfp4_gemm(x.data_ptr(), blocks.data_ptr(), out.data_ptr(), m, n, k,
                                                       int(x.dtype == torch.bfloat16), scratch.data_ptr()) != 0:
        raise KernelUnavailable(f"mxfp4_gemm takes 1-{MXFP4_MAX_ROWS} rows, K a multiple of 32 and 17 bytes a "
                                f"block (got {m} x {k}, blocks {tuple(blocks.shape)})")
    return out


def mxfp4_dequant(blocks: torch.Tensor, in_features: int, dtype: torch.dtype,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense weight [N, K] in `dtype` (float32 or bfloat16) of MXFP4 `blocks` [N, K/32 * 17] as
    mxfp4_gemm reads them (see mxfp4_gemm.c); into `out` if given."""
    n = blocks.shape[0]
    assert blocks.is_contiguous() and blocks.shape[1] * 32 == in_features * 17
    if out is None:
        out = torch.empty(n, in_features, dtype=dtype)
    assert out.shape == (n, in_features) and out.dtype == dtype and out.is_contiguous()
    assert dtype in (torch.float32, torch.bfloat16)
    load().mxfp4_dequant(blocks.data_ptr(), out.data_ptr(), n, in_features, int(dtype == torch.bfloat16))
    return out
