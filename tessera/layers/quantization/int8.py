"""Int8 weights in the checkpoint's groups (a scale per 16 or 32 values), multiplied by
Tessera's grouped int8 kernels for few rows and a dense product for many."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from tessera.kernels import bindings, capabilities, library, matmul_ops
from tessera.layers.quantization.base import (
    INT8_REQUANT_GROUP, LOAD_CHUNK_ROWS, QuantConfig, WeightOnlyMethod,
)
from tessera.layers.weights import INT8_GROUPS, AnyWeight, GGUFWeight


def quantize_int8(w: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Round a float [N, K] weight to symmetric int8 groups of `group` values (max |w| per group)."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    scale = (g.abs().amax(dim=-1) / 127.0).clamp_min(1e-12)
    codes = torch.round(g / scale[..., None]).clamp_(-127, 127).to(torch.int8).view(n, k)
    return codes, scale


class Int8Method(WeightOnlyMethod):
    """Int8 codes with a float32 scale (and, for asymmetric types, a zero) per group of 16 or 32
    values along each row: GGUF Q8_0, Q5_0, Q5_1, Q5_K and Q6_K blocks keep their own codes and
    scales (`GGUFWeight.int8_groups`), so the product is the file's weights exactly; any other
    source is rounded to symmetric groups of 32.

    Up to 8 rows at a time go through Tessera's C kernels (tessera/kernels/int8_gemv.c), a
    larger small batch in slices of 8: float32 accumulation over the exact weights, or from 3
    bfloat16 rows AVX512-BF16 dot products over the weights rounded once to bfloat16.
    """

    name = "int8"

    @staticmethod
    def layout(ggml_types: Sequence[Optional[int]], in_features: int) -> tuple[int, bool]:
        """(group size, whether zeros are kept) for a weight made of pieces of these GGUF types
        (None: a float tensor): the finest of the pieces' groups, zeros if any piece has them."""
        groups, zeros = [], False
        for t in ggml_types:
            g, z = INT8_GROUPS.get(t, (INT8_REQUANT_GROUP, False)) if t is not None else (INT8_REQUANT_GROUP, False)
            groups.append(g)
            zeros = zeros or z
        group = min(groups)
        while in_features % group:
            group //= 2  # a float matrix whose width is not a multiple of 32 (never a GGUF one)
        return max(group, 1), zeros

    @staticmethod
    def storage_bytes(rows: int, cols: int, config: QuantConfig, ggml_types: Sequence[Optional[int]] = ()) -> int:
        """Bytes `load` keeps: codes, float32 scales (and zeros) per group, and the dense copy
        when one is kept."""
        group, zeros = Int8Method.layout(ggml_types or [None], cols)
        dense = rows * cols * config.dtype.itemsize if config.dense_copy else 0
        return rows * cols + rows * (cols // group) * 4 * (2 if zeros else 1) + dense

    def load(self, layer, sources):
        # A few thousand rows at a time, so no float32 copy of a whole large matrix (a 151k x
        # 1536 LM head would be 0.9 GB) ever exists.
        rows, cols = sum(s.shape[0] for s in sources), sources[0].shape[1]
        types = [s.ggml_type if isinstance(s, GGUFWeight) else None for s in sources]
        group, has_zeros = self.layout(types, cols)
        q = torch.empty(rows, cols, dtype=torch.int8)
        scale = torch.empty(rows, cols // group, dtype=torch.float32)
        zero = torch.zeros(rows, cols // group, dtype=torch.float32) if has_zeros else None
        r, exact = 0, True
        for src in sources:
            for c, sc, z in self._groups(src):
                # A piece with coarser groups (Q8_0's 32 beside Q6_K's 16) repeats its scales.
                rep = scale.shape[1] // sc.shape[1]
                q[r:r + len(c)] = c
                scale[r:r + len(c)] = sc.repeat_interleave(rep, dim=1) if rep > 1 else sc
                if zero is not None and z is not None:
                    zero[r:r + len(c)] = z.repeat_interleave(rep, dim=1) if rep > 1 else z
                r += len(c)
            exact = exact and isinstance(src, GGUFWeight) and src.ggml_type in INT8_GROUPS
        layer.register_buffer("qweight", q, persistent=False)
        layer.register_buffer("scales", scale, persistent=False)
        if zero is not None:
            layer.register_buffer("zeros", zero, persistent=False)
        else:
            layer.zeros = None
        layer.int8_exact = exact
        layer.use_kernels = library.available() is None and group % 16 == 0
        layer.use_gemm_kernel = (layer.use_kernels and self.config.dtype == torch.bfloat16 and cols % 32 == 0
                                 and capabilities.bf16_matmuls())
        # float32 rows of up to 8 (the LM head's decode and verification rows) rounded to int16 per 32
        # values where activations may be rounded
        layer.use_i16_kernel = (layer.use_kernels and self.config.dtype == torch.float32 and cols % 32 == 0
                                and self.config.int8_activations and capabilities.int16_row_products())
        self._finish(layer)

    def _groups(self, src: AnyWeight):
        """(codes, scale, zero or None) chunks of rows: the file's own for INT8_GROUPS types,
        else symmetric groups of INT8_REQUANT_GROUP (or finer, see `layout`)."""
        if isinstance(src, GGUFWeight) and src.ggml_type in INT8_GROUPS:
            for i in range(0, src.shape[0], LOAD_CHUNK_ROWS):
                part = src.raw[i:i + LOAD_CHUNK_ROWS]
                yield GGUFWeight(part, src.ggml_type, (len(part), src.shape[1])).int8_groups()
        else:
            group, _ = self.layout([None], src.shape[1])
            for w in src.row_chunks(LOAD_CHUNK_ROWS):
                yield (*quantize_int8(w, group), None)

    def _weights(self, layer: nn.Module, rows: "slice | Tensor") -> Tensor:
        """Rows of the weight in float32: code * scale (+ zero) per group."""
        q, sc = layer.qweight[rows], layer.scales[rows]
        g = q.view(q.shape[0], sc.shape[1], -1).float()
        w = torch.addcmul(layer.zeros[rows].unsqueeze(-1), g, sc.unsqueeze(-1)) if layer.zeros is not None \
            else g * sc.unsqueeze(-1)
        return w.view(q.shape[0], -1)

    def dequantize(self, layer):
        return self._weights(layer, slice(None)).to(self.config.dtype)

    def embedding(self, layer, ids):
        flat = ids.reshape(-1)
        return self._weights(layer, flat).to(self.config.dtype).view(*ids.shape, -1)

    def _small(self, layer, x):
        if not layer.use_kernels:
            return (x.float() @ self._weights(layer, slice(None)).T).to(x.dtype)
        i16 = layer.use_i16_kernel and x.dtype == torch.float32
        gemm = layer.use_gemm_kernel and x.dtype == torch.bfloat16 and x.shape[0] >= 3
        step = bindings.INT8_GEMM_MAX_ROWS if gemm else bindings.INT8_GEMV_MAX_ROWS
        parts = []
        for i in range(0, x.shape[0], step):
            rows = x[i:i + step]
            if gemm and rows.shape[0] >= 3:
                parts.append(matmul_ops.int8_gemm_bf16(rows, layer.qweight, layer.scales, layer.zeros))
            elif i16:
                parts.append(matmul_ops.int8_gemv_i16(rows, layer.qweight, layer.scales, layer.zeros))
            else:
                parts.append(matmul_ops.int8_gemv(rows, layer.qweight, layer.scales, layer.zeros))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def kernel_operand(self, layer):
        if not layer.use_kernels:
            return None
        n, k = layer.qweight.shape
        kind = bindings.LINEAR_INT8_I16 if layer.use_i16_kernel else bindings.LINEAR_INT8
        return bindings.LinearOperand(kind=kind, weight=layer.qweight.data_ptr(),
                                     scales=layer.scales.data_ptr(),
                                     zeros=None if layer.zeros is None else layer.zeros.data_ptr(),
                                     n_pad=n, n=n, k=k, group=k // layer.scales.shape[1],
                                     int8_gemm=int(layer.use_gemm_kernel))

    def describe(self, layer):
        return ("int8" + ("" if layer.int8_exact else " (requantized)")
                + (" (int16 activations)" if layer.use_i16_kernel else ""))
