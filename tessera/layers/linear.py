"""Linear layers whose weight storage and matmul come from a quantization method.

A `Linear` may be merged from several checkpoint tensors (Q, K and V into one
QKV projection; gate and up into one): the model's packed-module map routes
each checkpoint tensor to `weight_loader(source, shard)`, and once every shard
has arrived the layer picks its method (from all shards' formats, so
`--quantization auto` can keep the checkpoint's precision) and stores the
weight. Until then the shards wait as their raw sources, so nothing is
dequantized twice and no shard outlives its layer's loading.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.kernels import bindings
from tessera.errors import ModelFormatError
from tessera.layers.lora import LoRATable
from tessera.layers.quantization import Activation, QuantConfig, QuantMethod, method_for
from tessera.layers.weights import AnyWeight, as_source


class Linear(nn.Module):
    """y = x W^T (+ b), W [sum(output_sizes), input_size] stored by a QuantMethod.

    `int8_inputs`: whether the method may round this layer's input to int8 per group of 32 (the
    int4 weights' int8-activation kernel); False for inputs with outlier channels that a shared
    group scale would flatten (see GatedMLP)."""

    def __init__(self, input_size: int, output_sizes: Union[int, Sequence[int]], quant: QuantConfig,
                 bias: bool = False, shard_names: Optional[Sequence[str]] = None, prefix: str = "",
                 int8_inputs: bool = True):
        super().__init__()
        self.int8_inputs = int8_inputs
        self.input_size = input_size
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.quant = quant
        self.prefix = prefix
        self.shard_names = list(shard_names) if shard_names is not None else [str(i) for i in
                                                                             range(len(self.output_sizes))]
        self.quant_method: Optional[QuantMethod] = None
        self.bias: Optional[Tensor] = None
        self._has_bias = bias
        self._pending: dict[str, AnyWeight] = {}
        self._pending_bias: dict[str, Tensor] = {}
        # Adapters beside the stored weight (layers/lora.py); set by the model when LoRA is enabled.
        self.lora: Optional[LoRATable] = None

    @property
    def loaded(self) -> bool:
        return self.quant_method is not None and (not self._has_bias or self.bias is not None)

    def missing_parts(self) -> list[str]:
        """Parts whose weight has not arrived yet (all of them before loading starts)."""
        if self.quant_method is not None:
            return []
        return [n for n in self.shard_names if n not in self._pending]

    def _shard_size(self, shard: Optional[str], what: str) -> tuple[str, int]:
        shard = shard if shard is not None else self.shard_names[0]
        if shard not in self.shard_names:
            raise ModelFormatError(f"{self.prefix}: unknown part {shard!r} for {what}")
        return shard, self.output_sizes[self.shard_names.index(shard)]

    def weight_loader(self, weight: Union[Tensor, AnyWeight], shard: Optional[str] = None) -> None:
        """Take one checkpoint tensor (float or GGUF blocks) for part `shard` of this layer."""
        src = as_source(weight)
        shard, rows = self._shard_size(shard, "weight")
        if tuple(src.shape) != (rows, self.input_size):
            raise ModelFormatError(
                f"weight {self.prefix}{'' if len(self.shard_names) == 1 else '.' + shard} has shape "
                f"{tuple(src.shape)} but the config implies {(rows, self.input_size)}; the file's "
                "metadata and tensors disagree")
        self._pending[shard] = src
        if len(self._pending) == len(self.shard_names):
            sources = [self._pending.pop(n) for n in self.shard_names]
            self.quant_method = method_for(self.quant, sources)
            self.quant_method.load(self, sources)

    def bias_loader(self, bias: Tensor, shard: Optional[str] = None) -> None:
        shard, rows = self._shard_size(shard, "bias")
        if tuple(bias.shape) != (rows,):
            raise ModelFormatError(f"bias {self.prefix}.{shard} has shape {tuple(bias.shape)}, expected ({rows},)")
        self._pending_bias[shard] = bias.float()
        if len(self._pending_bias) == len(self.shard_names):
            b = torch.cat([self._pending_bias.pop(n) for n in self.shard_names])
            self.bias = b.to(self.quant.dtype)

    def forward(self, x: Tensor, activation: Optional[Activation] = None, residual: Optional[Tensor] = None) -> Tensor:
        """x W^T (+ b), then `activation` (GELU) or `+ residual` when given: applied by the matrix
        product itself where the method can (dense bfloat16: oneDNN's post-ops), which saves a
        pass over the output each."""
        if self.lora is not None and self.lora.slots.active:
            return self._forward_lora(x, activation, residual)
        if self.bias is None and activation is None and residual is None:
            return self.quant_method.apply(self, x)
        return self.quant_method.apply_with_bias(self, x, self.bias, activation, residual)

    def _forward_lora(self, x: Tensor, activation: Optional[Activation], residual: Optional[Tensor]) -> Tensor:
        """The product with the step's adapters added before the activation and the residual
        (which the method would otherwise fold into the product)."""
        y = self.quant_method.apply(self, x) if self.bias is None else \
            self.quant_method.apply_with_bias(self, x, self.bias, None, None)
        self.lora.add_to(x.reshape(-1, self.input_size), y.view(-1, self.output_size))
        if activation is not None:
            y = F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")
        return y if residual is None else y + residual

    def kernel_operand(self) -> Optional[bindings.LinearOperand]:
        """This layer's weight and bias as the C decode step reads them, or None (see
        QuantMethod.kernel_operand)."""
        op = self.quant_method.kernel_operand(self) if self.quant_method is not None else None
        if op is not None and self.bias is not None:
            if self.bias.dtype not in (torch.bfloat16, torch.float32) or not self.bias.is_contiguous():
                return None
            op.bias = self.bias.data_ptr()
        return op

    def extra_repr(self) -> str:
        how = self.quant_method.describe(self) if self.quant_method else "unloaded"
        return f"in={self.input_size}, out={self.output_size}, {how}"


class VocabEmbedding(Linear):
    """Token embedding table that can double as the LM head (tied weights, one stored copy)."""

    def __init__(self, vocab_size: int, hidden_size: int, quant: QuantConfig, prefix: str = ""):
        super().__init__(hidden_size, vocab_size, quant, prefix=prefix)

    def embed(self, ids: Tensor) -> Tensor:
        return self.quant_method.embedding(self, ids)
