"""Q6_K and Q4_K weights kept in the file's super-blocks, multiplied with int8 activations by
the K-quant kernels (bfloat16 or float32 compute)."""
from __future__ import annotations

from abc import abstractmethod
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from tessera.kernels import bindings, capabilities, gguf_ops
from tessera.layers.quantization.base import (
    KQ_BLOCK, LOAD_CHUNK_ROWS, SMOOTHING_ALPHA, QuantConfig, WeightOnlyMethod, dense_linear,
)
from tessera.layers.weights import GGUFWeight


# Where PyTorch's int8 product is slow, steps up to this many rows still go through the kernels in
# slices of 8 (compute-bound there: the same time a row at any count) rather than float32 sgemm,
# which widens every weight for the call: over qwen2.5-coder-1.5b's K-quant layers on an AMD EPYC
# with AVX2 alone, float32 took 2.10x the sliced kernels' time at 33 rows, 1.38x at 64, 1.07x at
# 128 and 0.94x at 256 (benchmarks/results/kquant/sliced_avx2.json).
SLICED_MAX_ROWS = 128


class KQuantMethod(WeightOnlyMethod):
    """GGUF K-quant matrices at the file's width, multiplied by activations quantized to int8 per
    256 values (tessera/kernels/kquant_gemm.c): integer dot products per super-block (pmaddubsw,
    then the sub-block's scale by pmaddwd or VNNI's vpdpwssd), one or two float multiplies per
    super-block. The activations' rounding (Q8_K's, as llama.cpp's own K-quant products do) is
    the price; `QuantConfig.int8_activations=False` keeps the int8 and int4 layouts with
    bfloat16 activations, and benchmarks/perplexity.py --activations measures the difference.

    Up to 8 rows a call, a larger small batch in slices of 8 (up to SLICED_MAX_ROWS where PyTorch's
    int8 product is slow); larger steps multiply a dense copy (kept) or go through `_int8_matmul`.
    Subclasses say how a kind is stored (`storage_bytes`, `_blocks`), decoded (`_weights`,
    float32) and multiplied (`kernel`).
    """

    kernel: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # x, codes, scales, floats -> x @ W.T

    def load(self, layer, sources):
        rows, cols = sum(s.shape[0] for s in sources), sources[0].shape[1]
        parts: list[list[Tensor]] = []
        for src in sources:
            for i in range(0, src.shape[0], LOAD_CHUNK_ROWS):
                part = src.raw[i:i + LOAD_CHUNK_ROWS]
                parts.append(list(self._blocks(GGUFWeight(part, src.ggml_type, (len(part), cols)))))
        buffers = [torch.cat(p) if len(parts) > 1 else p[0] for p in zip(*parts)]
        assert buffers[0].shape[0] == rows
        for name, b in zip(("qweight", "scales", "d"), buffers):
            layer.register_buffer(name, b, persistent=False)
        self._finish(layer)

    @staticmethod
    @abstractmethod
    def _blocks(src: GGUFWeight) -> tuple[Tensor, Tensor, Tensor]: ...

    @abstractmethod
    def _weights(self, layer: nn.Module, rows: "slice | Tensor") -> Tensor: ...

    def dequantize(self, layer):
        if self.config.dtype == torch.bfloat16:  # as storage_for picks these: in C, not a dozen torch passes
            in_features = layer.scales.shape[1] * 16  # both kinds keep 16 scale bytes per 256 values
            return gguf_ops.kquant_dequant_bf16(self.name, layer.qweight, layer.scales, layer.d, in_features)
        return self._weights(layer, slice(None)).to(self.config.dtype)

    def embedding(self, layer, ids):
        flat = ids.reshape(-1)
        return self._weights(layer, flat).to(self.config.dtype).view(*ids.shape, -1)

    def _small(self, layer, x):
        step = bindings.KQUANT_MAX_ROWS
        parts = [self.kernel(x[i:i + step], layer.qweight, layer.scales, layer.d) for i in range(0, x.shape[0], step)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def apply(self, layer, x):
        rows = x.shape[0]
        if rows <= self.config.small_batch_max or (rows <= SLICED_MAX_ROWS and not capabilities.int8_products_fast()):
            return self._small(layer, x)
        dense = getattr(layer, "dense_weight", None)
        if dense is not None:
            return dense_linear(x, dense)
        return self._int8_matmul(layer, x)

    def _int8_matmul(self, layer: nn.Module, x: Tensor) -> Tensor:
        """A prefill-sized step as int8 x int8 -> int32 (gguf_ops.int8_matmul: torch._int_mm, oneDNN's
        VNNI kernels): the activations quantized per token, the weight requantized per row from
        the file's blocks for the call (in C, as `dequantize` does for bfloat16), both smoothed by
        the step's column maxima (SMOOTHING_ALPHA), then one float32 multiply by the two scales.
        Every step past the few-row kernels (without a dense copy) takes it: against the bfloat16
        product of the weight dequantized for the call, qwen2.5-coder-1.5b's K-quant layers ran
        1.16x at 33 rows and 1.19-1.38x at 64-512 (benchmarks/kquant.py --prefill);
        benchmarks/perplexity.py measures what the roundings cost. Where PyTorch has no fast int8
        product (AVX2 alone: capabilities.int8_products_fast), the same int8 rows are multiplied
        in float32 instead, the activations unrounded."""
        n, k = layer.d.shape[0], layer.scales.shape[1] * 16
        ws = self.config.workspace
        if not capabilities.int8_products_fast():  # AVX2 alone: float32 sgemm over the int8 rows
            wq, row_scales = gguf_ops.kquant_dequant_int8(self.name, layer.qweight, layer.scales, layer.d, k,
                                                         ws.get("weight", (n, k), torch.int8))
            return gguf_ops.int8_weight_matmul_f32(x, wq, row_scales).to(x.dtype)
        columns = x.abs().amax(dim=0).float().clamp_min_(1e-5).pow_(SMOOTHING_ALPHA)
        wq, row_scales = gguf_ops.kquant_dequant_int8(self.name, layer.qweight, layer.scales, layer.d, k,
                                                     ws.get("weight", (n, k), torch.int8), columns)
        return gguf_ops.int8_matmul(x, wq, row_scales, ws.get("products", (x.shape[0], n), torch.int32), columns)

    def kernel_operand(self, layer):
        """Up to `small_batch_max` rows, as `apply` routes them: past that the C step declines."""
        if not capabilities.kquant_matmuls():
            return None
        n = layer.d.shape[0]
        kind = bindings.LINEAR_Q4K if self.name == "q4_k" else bindings.LINEAR_Q6K
        return bindings.LinearOperand(kind=kind, weight=layer.qweight.data_ptr(), scales=layer.scales.data_ptr(),
                                     zeros=layer.d.data_ptr(), n_pad=n, n=n, k=layer.scales.shape[1] * 16,
                                     max_rows=self.config.small_batch_max)

    def describe(self, layer):
        return f"{self.name} (int8 activations)"


class Q6KMethod(KQuantMethod):
    """Q6_K at 0.83 bytes a weight (192 code bytes, 16 int8 scales and a float32 d per 256
    values) against int8 groups' 1.25: a Q4_K_M model's LM head and half its down projections
    stream a third fewer bytes a decode step. Dequantized, the weight is Int8Method's (the same
    code x (d x sc) in float32)."""

    name = "q6_k"
    kernel = staticmethod(gguf_ops.q6k_gemm)

    @staticmethod
    def storage_bytes(rows: int, cols: int, config: QuantConfig, ggml_types: Sequence[Optional[int]] = ()) -> int:
        dense = rows * cols * config.dtype.itemsize if config.dense_copy else 0
        return rows * (cols // KQ_BLOCK) * (192 + 16 + 4) + dense

    @staticmethod
    def _blocks(src):
        return src.q6k_blocks()

    def _weights(self, layer, rows):
        """Rows of the weight in float32: (code - 32) x d x sc per 16 values."""
        b = layer.qweight[rows]
        n = b.shape[0]
        b = b.view(n, -1, 192)
        ql0, ql1, qh = b[..., :64], b[..., 64:128], b[..., 128:]
        codes = torch.cat([(ql0 & 15) | ((qh & 3) << 4), (ql0 >> 4) | (((qh >> 2) & 3) << 4),
                           (ql1 & 15) | (((qh >> 4) & 3) << 4), (ql1 >> 4) | ((qh >> 6) << 4)], dim=-1)
        scale = layer.d[rows].repeat_interleave(16, dim=1) * layer.scales[rows].float()  # [n, K/16]
        w = (codes.view(n, scale.shape[1], 16).float() - 32) * scale.unsqueeze(-1)
        return w.view(n, -1)


class Q4KMethod(KQuantMethod):
    """Q4_K at 0.59 bytes a weight (128 code bytes, 8 scales and 8 minimums, float32 d and dmin
    per 256 values) against int4pack's 0.625 (bfloat16 scale and zero per 32), and the products
    in integers (int4_gemv.c widens every code to bfloat16)."""

    name = "q4_k"
    kernel = staticmethod(gguf_ops.q4k_gemm)

    @staticmethod
    def storage_bytes(rows: int, cols: int, config: QuantConfig, ggml_types: Sequence[Optional[int]] = ()) -> int:
        dense = rows * cols * config.dtype.itemsize if config.dense_copy else 0
        return rows * (cols // KQ_BLOCK) * (128 + 16 + 8) + dense

    @staticmethod
    def _blocks(src):
        return src.q4k_blocks()

    def _weights(self, layer, rows):
        """Rows of the weight in float32: d x sc x code - dmin x mn per 32 values."""
        b = layer.qweight[rows]
        n = b.shape[0]
        b = b.view(n, -1, 128)
        lo, hi = b[..., :64], b[..., 64:]
        codes = torch.cat([lo & 15, lo >> 4, hi & 15, hi >> 4], dim=-1).view(n, -1, 32).float()  # [n, K/32, 32]
        sm = layer.scales[rows].view(n, -1, 16).float()
        dm = layer.d[rows]  # [n, K/256, 2]
        scale = (dm[..., :1] * sm[..., :8]).reshape(n, -1, 1)
        minimum = (dm[..., 1:] * sm[..., 8:]).reshape(n, -1, 1)
        return (codes * scale - minimum).view(n, -1)
