"""The gated MLP of llama-family and Gemma decoders: down(act(gate(x)) * up(x)), gate and up fused."""
from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera import kernels
from tessera.layers.linear import Linear
from tessera.layers.quantization import QuantConfig


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, quant: QuantConfig,
                 activation: Literal["silu", "gelu_tanh"], prefix: str):
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unknown activation {activation!r}")
        self.activation = activation
        self.gate_up_proj = Linear(hidden_size, [intermediate_size] * 2, quant, shard_names=["gate", "up"],
                                   prefix=prefix + ".gate_up_proj")
        # The product act(gate) * up carries the block's outlier channels: rounded to int8 per group
        # of 32 (int4 weights' int8-activation kernel) it cost SmolLM2-135M +1.2 % perplexity alone,
        # the other projections together +0.6 % (docs/models.md, "int8 activations").
        self.down_proj = Linear(intermediate_size, hidden_size, quant, prefix=prefix + ".down_proj",
                                int8_inputs=False)
        # SiLU x up in one C pass (kernels.silu_mul) where the AVX512-BF16 kernels run; decided on
        # the first bfloat16 call. Two PyTorch passes took ~70 ms of a 1 s SmolLM2 prefill step.
        self._c_silu: Optional[bool] = None

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation == "silu" and gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2 and gate_up.is_cpu:
            if self._c_silu is None:
                self._c_silu = kernels.bf16_matmuls()
            if self._c_silu:
                return self.down_proj(kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(act * up)
