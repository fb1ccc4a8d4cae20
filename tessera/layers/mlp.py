"""The decoders' gated MLP, down(act(gate(x)) * up(x)) with gate and up fused (the activations are
tessera/activations.py's table), which is also each expert of a mixture-of-experts block
(layers/moe.py)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.activations import ACTIVATIONS, ActivationName, activation as lookup_activation
from tessera.kernels import capabilities, rowwise_ops
from tessera.layers.linear import Linear
from tessera.layers.quantization import QuantConfig

Activation = ActivationName


def _swiglu_clamped(mlp: "GatedMLP", gate: Tensor, up: Tensor) -> Tensor:
    gate = gate.clamp(max=mlp.limit)
    return gate * torch.sigmoid(gate * mlp.alpha) * (up.clamp(-mlp.limit, mlp.limit) + 1)


# act(gate) * up for each name of tessera/activations.py's table, in PyTorch's operators (the C decode
# step has its own body per code there).
GATED: dict[str, Callable[["GatedMLP", Tensor, Tensor], Tensor]] = {
    "silu": lambda mlp, gate, up: F.silu(gate) * up,
    "gelu_tanh": lambda mlp, gate, up: F.gelu(gate, approximate="tanh") * up,
    "swiglu_clamped": _swiglu_clamped,
}
assert set(GATED) == set(ACTIVATIONS), "every activation of the table has a module body"


class GatedMLP(nn.Module):
    """`swiglu_clamped` is gpt-oss's: (up.clamp(+-limit) + 1) * g * sigmoid(alpha * g) with
    g = gate.clamp(max=limit); `bias`: biases on both projections (gpt-oss's experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, quant: QuantConfig, activation: Activation,
                 prefix: str, bias: bool = False, swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702):
        super().__init__()
        lookup_activation(activation)  # ValueError for a name not in the table
        self.activation = activation
        self.limit, self.alpha = swiglu_limit, swiglu_alpha
        self.gate_up_proj = Linear(hidden_size, [intermediate_size] * 2, quant, bias=bias, shard_names=["gate", "up"],
                                   prefix=prefix + ".gate_up_proj")
        # The product act(gate) * up carries the block's outlier channels: rounded to int8 per group
        # of 32 (int4 weights' int8-activation kernel) it cost SmolLM2-135M +1.2 % perplexity alone,
        # the other projections together +0.6 % (docs/models.md, "int8 activations").
        self.down_proj = Linear(intermediate_size, hidden_size, quant, bias=bias, prefix=prefix + ".down_proj",
                                int8_inputs=False)
        # SiLU x up in one C pass (rowwise_ops.silu_mul) where the AVX512-BF16 kernels run; decided on
        # the first bfloat16 call. Two PyTorch passes took ~70 ms of a 1 s SmolLM2 prefill step.
        self._c_silu: Optional[bool] = None

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation == "silu" and gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2 and gate_up.is_cpu:
            if self._c_silu is None:
                self._c_silu = capabilities.bf16_matmuls()
            if self._c_silu:
                return self.down_proj(rowwise_ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(GATED[self.activation](self, gate, up))
