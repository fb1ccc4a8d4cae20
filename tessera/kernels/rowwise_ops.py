"""Tensor wrappers of the row-wise kernels: RMSNorm with its residual add (rms_norm.c) and the
MLP's silu(gate) * up."""
from __future__ import annotations

from typing import Optional

import torch

from tessera.kernels.library import load


NORM_DTYPES = (torch.bfloat16, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm of bfloat16 or float32 rows [T, H]; with `residual`, first residual += x in place
    and normalise that. Contiguous inputs of one dtype in NORM_DTYPES, H <= MAX_NORM_HIDDEN."""
    lib = load()
    out = torch.empty_like(x)
    fn = lib.rms_norm_bf16 if x.dtype == torch.bfloat16 else lib.rms_norm_f32
    fn(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                      out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for bfloat16 rows [T, 2I] of [gate | up] -> [T, I], in one pass (roundings
    as F.silu then a multiply: bfloat16 after each)."""
    assert gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0
    gate_up = gate_up.contiguous()
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, i), dtype=torch.bfloat16)
    load().silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), t, i)
    return out
