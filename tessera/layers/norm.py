"""RMSNorm, with the residual add folded into the same call as vLLM's layers do."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.errors import ModelFormatError


class RMSNorm(nn.Module):
    """x / rms(x) * weight. `offset` adds a constant to the stored scale at load time (Gemma's
    checkpoints store w of (1 + w))."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, offset: float = 0.0, prefix: str = ""):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.offset = offset
        self.prefix = prefix
        self.register_buffer("weight", torch.empty(hidden_size, dtype=dtype, device="meta"), persistent=False)

    def weight_loader(self, w: Tensor) -> None:
        if tuple(w.shape) != (self.hidden_size,):
            raise ModelFormatError(f"norm {self.prefix} has shape {tuple(w.shape)}, expected ({self.hidden_size},)")
        self.weight = (w.float() + self.offset).to(self.weight.dtype)

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        """Normalize x, or (x + residual) returning (normalized, new residual) when residual is given."""
        if residual is None:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        residual = x + residual
        return F.rms_norm(residual, (self.hidden_size,), self.weight, self.eps), residual
