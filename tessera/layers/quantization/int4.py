"""Int4 weights in PyTorch's CPU int4pack layout (the host's tiles), multiplied by Tessera's
int4 kernels for few rows (bfloat16, int8-activation and AVX2 float32 forms), PyTorch's
weight-only kernel or a dense product.

A float32 server on an AVX-512 host without AVX512-BF16 packs the AVX2 layout itself instead
of the host's: no kernel of ours reads the AVX-512 layout in float32, and PyTorch's float32
int4pack product runs at ~1 GFLOP/s (a SmolLM2-135M decode step took 213 ms, 96 % of it there,
on an Intel Xeon with AVX-512 VNNI and no BF16), while the AVX2 + FMA kernel runs on any
AVX-512 host."""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from tessera.kernels import bindings, capabilities, library, matmul_ops
from tessera.layers.quantization.base import (
    INT4_GEMM_MAX_ROWS, INT4_GROUP, INT4_ROW_TILE, LOAD_CHUNK_ROWS, Int4PackLayout, QuantConfig, WeightOnlyMethod,
    dense_linear, int4pack_layout,
)
from tessera.layers.weights import AnyWeight, GGUFWeight


AVX2_LAYOUT = Int4PackLayout(32, tuple(2 * r if r < 16 else 2 * (r - 16) + 1 for r in range(32)))


def pack_avx2_layout(codes: Tensor) -> Tensor:
    """[N, K] codes (0..15, N a multiple of 32) packed as PyTorch packs them on AVX2 hosts:
    tiles of 32 rows, each column k of a tile 16 bytes, byte c holding row c in its low nibble
    and row 16 + c in its high one ([N, K/2] bytes, tile after tile)."""
    n, k = codes.shape
    tiles = codes.to(torch.uint8).view(n // 32, 32, k)
    pairs = tiles[:, :16] | (tiles[:, 16:] << 4)  # [T, 16, K]
    return pairs.transpose(1, 2).contiguous().view(n, k // 2)


class Int4Method(WeightOnlyMethod):
    """Group-wise asymmetric int4 (groups of 32) in PyTorch's CPU int4pack layout."""

    name = "int4"

    @staticmethod
    def storage_bytes(rows: int, cols: int, config: QuantConfig, ggml_types: Sequence[Optional[int]] = ()) -> int:
        """Bytes `load` keeps: packed codes over rows padded to the int4pack tile, a scale and a
        zero per group of 32 in the compute dtype, and the dense copy when one is kept."""
        padded = -(-rows // INT4_ROW_TILE) * INT4_ROW_TILE
        dense = rows * cols * config.dtype.itemsize if config.dense_copy else 0
        return padded * cols // 2 + (cols // INT4_GROUP) * padded * 2 * config.dtype.itemsize + dense

    def load(self, layer, sources):
        # Codes, scales and zeros are gathered (and packed) a few thousand rows at a time: the
        # packing wants int32 codes, 4 bytes a weight, which for a 151k x 1536 table would be
        # 0.9 GB at once.
        n, k = sum(s.shape[0] for s in sources), sources[0].shape[1]
        n_pad = n + (-n % INT4_ROW_TILE)  # the packed layout needs whole tiles of 64 rows
        codes = torch.zeros(n_pad, k, dtype=torch.uint8)
        scale = torch.zeros(n_pad, k // INT4_GROUP)
        zero = torch.zeros(n_pad, k // INT4_GROUP)
        r, exact = 0, True
        for src in sources:
            for c, sc, z in self._groups(src):
                codes[r:r + len(c)], scale[r:r + len(c)], zero[r:r + len(c)] = c, sc, z
                r += len(c)
            exact = exact and isinstance(src, GGUFWeight) and src.int4_exact
        packed = torch.empty(n_pad, k // 2, dtype=torch.uint8)
        step = LOAD_CHUNK_ROWS  # a multiple of the 64-row tile: tiles pack independently
        own = self.layout is not int4pack_layout()
        for i in range(0, n_pad, step):
            chunk = codes[i:i + step]
            packed[i:i + step] = (pack_avx2_layout(chunk) if own
                                  else torch._convert_weight_to_int4pack_for_cpu(chunk.to(torch.int32), 1))
        del codes
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(self.config.dtype)
        layer.register_buffer("qweight", packed, persistent=False)
        layer.register_buffer("scales_zeros", sz, persistent=False)  # [K/32, N_padded, 2]
        layer.out_rows = n
        layer.int4_exact = exact
        native = self.config.dtype == torch.bfloat16 and self.layout.kernel_layout and capabilities.bf16_matmuls()
        layer.use_gemm_kernel = native
        layer.use_i8_kernel = native and getattr(layer, "int8_inputs", True) and self.int8_activation_kernel(self.config)
        layer.use_f32_kernel = self.config.dtype == torch.float32 and self.layout.avx2_layout \
            and capabilities.avx2_matmuls()
        # float32 rows quantized to int8 per group of 32 (int4_gemm_i8_f32): a quarter of the float
        # kernel's instructions a weight, which kept two AVX2 cores below the memory's rate
        layer.use_i8_f32_kernel = layer.use_f32_kernel and getattr(layer, "int8_inputs", True) \
            and self.config.int8_activations
        layer.torch_layout = self.layout is int4pack_layout()  # PyTorch's own int4pack product reads it
        self._finish(layer)

    @staticmethod
    def int8_activation_kernel(config: QuantConfig) -> bool:
        """Whether int4 weights multiply int8-quantized activations here (int4_gemm_i8, AVX512-VNNI:
        bfloat16 compute, `int8_activations` on, the AVX-512 int4pack layout), for the layers
        whose inputs allow it (`Linear.int8_inputs`). It then takes every step, one row to a whole
        prompt: over SmolLM2-135M's projections read from memory, on par with the bfloat16 kernel
        at one row, 1.1-1.5x faster at 2-32 rows, faster than the dense bfloat16 copy up to
        256 and level with it at 512 (benchmarks/kernels.py, results/int4_i8/)."""
        layout = int4pack_layout()
        return (config.dtype == torch.bfloat16 and config.int8_activations and layout is not None
                and layout.kernel_layout and capabilities.bf16_matmuls() and capabilities.int4_i8_matmuls())

    @staticmethod
    def _groups(src: AnyWeight):
        """(codes, scale, zero) chunks of rows: the file's own for Q4 GGUF types, else requantized."""
        if isinstance(src, GGUFWeight) and src.int4_exact:
            for i in range(0, src.shape[0], LOAD_CHUNK_ROWS):
                part = src.raw[i:i + LOAD_CHUNK_ROWS]
                yield GGUFWeight(part, src.ggml_type, (len(part), src.shape[1])).int4_groups()
        else:
            for w in src.row_chunks(LOAD_CHUNK_ROWS):
                yield quantize_int4(w)

    @functools.cached_property
    def layout(self) -> Int4PackLayout:
        """The layout this config packs: the host's, or the AVX2 one for float32 where the host's
        is another and the AVX2 + FMA kernel runs (see the module docstring). Cached: embedding
        lookups read it every step."""
        layout = int4pack_layout()
        assert layout is not None, "storage_for never picks int4 without a known int4pack layout"
        if self.config.dtype == torch.float32 and not layout.avx2_layout and capabilities.avx2_matmuls():
            return AVX2_LAYOUT
        return layout

    def _rows(self, layer: nn.Module, rows: Tensor) -> Tensor:
        """Dequantize selected output rows (see Int4PackLayout for where each code is)."""
        layout = self.layout
        k = layer.scales_zeros.shape[0] * INT4_GROUP
        tiles = layer.qweight.view(-1, k, layout.tile // 2)
        slot = layout.slot_tensor[rows % layout.tile]
        bytes_ = tiles[rows // layout.tile, :, slot // 2]  # [R, K]
        codes = (bytes_ >> (4 * (slot % 2)).unsqueeze(1).to(torch.uint8)) & 0x0F
        sz = layer.scales_zeros[:, rows].transpose(0, 1)  # [R, K/32, 2]
        w = (codes.view(len(rows), -1, INT4_GROUP).to(self.config.dtype) - 8) * sz[..., :1] + sz[..., 1:]
        return w.view(len(rows), k)

    def dequantize(self, layer):
        layout = self.layout
        k = layer.scales_zeros.shape[0] * INT4_GROUP
        tiles = layer.qweight.view(-1, k, layout.tile // 2)
        nt = tiles.shape[0]
        out = torch.empty(nt, layout.tile, k, dtype=self.config.dtype)
        out[:, layout.rows_in_nibble(0)] = (tiles & 0x0F).transpose(1, 2)
        out[:, layout.rows_in_nibble(1)] = (tiles >> 4).transpose(1, 2)
        w = out.view(-1, k // INT4_GROUP, INT4_GROUP)
        sz = layer.scales_zeros.transpose(0, 1)  # [N, K/32, 2]
        w.sub_(8).mul_(sz[..., :1]).add_(sz[..., 1:])
        return out.view(-1, k)[:layer.out_rows]

    def embedding(self, layer, ids):
        flat = ids.reshape(-1)
        return self._rows(layer, flat).view(*ids.shape, -1)

    def apply(self, layer, x):
        rows = x.shape[0]
        if rows > 0 and layer.use_i8_f32_kernel:  # every step, as the bfloat16 int8-activation kernel
            try:
                return matmul_ops.int4_gemm_i8_f32(x, layer.qweight, layer.scales_zeros, layer.out_rows)
            except library.KernelUnavailable:  # built without AVX2 + FMA: PyTorch's kernels from now on
                layer.use_f32_kernel = layer.use_i8_f32_kernel = False
        if rows <= bindings.INT4_F32_MAX_ROWS and layer.use_f32_kernel:
            try:
                return matmul_ops.int4_gemm_f32(x, layer.qweight, layer.scales_zeros, layer.out_rows)
            except library.KernelUnavailable:  # built without AVX2 + FMA: PyTorch's kernels from now on
                layer.use_f32_kernel = False
        if rows > 0 and layer.use_i8_kernel:
            try:
                return matmul_ops.int4_gemm_i8(x, layer.qweight, layer.scales_zeros, layer.out_rows)
            except library.KernelUnavailable:  # built without VNNI/VBMI: the bfloat16 paths from now on
                layer.use_i8_kernel = False
        if 0 < rows <= INT4_GEMM_MAX_ROWS and layer.use_gemm_kernel:
            try:
                return matmul_ops.int4_gemm_bf16(x, layer.qweight, layer.scales_zeros, layer.out_rows)
            except library.KernelUnavailable:  # built without AVX512-BF16: PyTorch's kernels from now on
                layer.use_gemm_kernel = False
        return super().apply(layer, x)

    def _small(self, layer, x):
        if not getattr(layer, "torch_layout", True):  # packed by us: PyTorch's kernel reads another layout
            dense = getattr(layer, "dense_weight", None)
            return dense_linear(x, dense if dense is not None else self.dequantize(layer))
        out = torch._weight_int4pack_mm_for_cpu(x, layer.qweight, INT4_GROUP, layer.scales_zeros)
        return out if out.shape[1] == layer.out_rows else out[:, :layer.out_rows]

    def kernel_operand(self, layer):
        """bfloat16: the AVX-512 layout and bfloat16 scales int4_gemm_bf16 (or int4_gemm_i8) reads;
        float32: the AVX2 layout and float32 scales of int4_gemm_f32, up to its row limit as `apply`."""
        if not (layer.use_gemm_kernel or layer.use_f32_kernel):
            return None
        sz = layer.scales_zeros
        kind = bindings.LINEAR_INT4_I8 if layer.use_i8_kernel or layer.use_i8_f32_kernel else bindings.LINEAR_INT4
        return bindings.LinearOperand(kind=kind, weight=layer.qweight.data_ptr(), scales=sz.data_ptr(),
                                     n_pad=sz.shape[1], n=layer.out_rows, k=sz.shape[0] * INT4_GROUP,
                                     max_rows=bindings.INT4_F32_MAX_ROWS
                                     if layer.use_f32_kernel and not layer.use_i8_f32_kernel else 0)

    def describe(self, layer):
        return "int4" + ("" if layer.int4_exact else " (requantized)") + (" (int8 activations)" if layer.use_i8_kernel or layer.use_i8_f32_kernel else "")


def quantize_int4(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Round a float [N, K] weight to asymmetric int4 groups of 32 (min/max per group)."""
    n, k = w.shape
    g = w.float().view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).view(n, k)
    return codes, scale, lo + 8.0 * scale
