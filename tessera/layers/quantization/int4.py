"""Int4 weights in PyTorch's CPU int4pack layout (the host's tiles), multiplied by Tessera's
int4 kernels for few rows (bfloat16 and int8-activation forms), PyTorch's weight-only kernel or
a dense product; in float32 where the AVX2 + FMA kernels run, in their own layout
(int4_f32_layout.py: codes with their half scales beside them).

Float32 never takes PyTorch's int4pack product: it runs at ~1 GFLOP/s (a SmolLM2-135M decode
step took 213 ms, 96 % of it there, on an Intel Xeon with AVX-512 VNNI and no BF16), while the
AVX2 + FMA kernels run on any AVX2 or AVX-512 host."""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from tessera.kernels import bindings, capabilities, library, matmul_ops
from tessera.layers.quantization import int4_f32_layout
from tessera.layers.quantization.base import (
    INT4_GEMM_MAX_ROWS, INT4_GROUP, INT4_ROW_TILE, LOAD_CHUNK_ROWS, Int4PackLayout, QuantConfig, WeightOnlyMethod,
    dense_linear, int4pack_layout,
)
from tessera.layers.weights import AnyWeight, GGUFWeight


def f32_kernels(config: QuantConfig) -> bool:
    """Whether int4 weights take the float32 kernels (and their layout): float32 compute where the
    AVX2 + FMA kernels are built."""
    return config.dtype == torch.float32 and capabilities.avx2_matmuls()


class Int4Method(WeightOnlyMethod):
    """Group-wise asymmetric int4 (groups of 32) in PyTorch's CPU int4pack layout."""

    name = "int4"

    @staticmethod
    def storage_bytes(rows: int, cols: int, config: QuantConfig, ggml_types: Sequence[Optional[int]] = ()) -> int:
        """Bytes `load` keeps: packed codes over rows padded to the int4pack tile, a scale and a
        zero per group of 32 in the compute dtype, and the dense copy when one is kept."""
        padded = -(-rows // INT4_ROW_TILE) * INT4_ROW_TILE
        dense = rows * cols * config.dtype.itemsize if config.dense_copy else 0
        if f32_kernels(config):
            return int4_f32_layout.storage_bytes(padded, cols) + dense
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
        step = LOAD_CHUNK_ROWS  # a multiple of the 64-row tile: tiles pack independently
        if self.f32_layout:
            packed = torch.cat([int4_f32_layout.pack(codes[i:i + step], scale[i:i + step], zero[i:i + step])
                                for i in range(0, n_pad, step)])
            layer.register_buffer("qweight", packed, persistent=False)  # [N_padded/32, K/32, 640]
        else:
            packed = torch.empty(n_pad, k // 2, dtype=torch.uint8)
            for i in range(0, n_pad, step):
                packed[i:i + step] = torch._convert_weight_to_int4pack_for_cpu(codes[i:i + step].to(torch.int32), 1)
            sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(self.config.dtype)
            layer.register_buffer("qweight", packed, persistent=False)
            layer.register_buffer("scales_zeros", sz, persistent=False)  # [K/32, N_padded, 2]
        del codes
        layer.out_rows = n
        layer.int4_exact = exact
        native = self.config.dtype == torch.bfloat16 and self.layout.kernel_layout and capabilities.bf16_matmuls()
        layer.use_gemm_kernel = native
        layer.use_i8_kernel = native and getattr(layer, "int8_inputs", True) and self.int8_activation_kernel(self.config)
        layer.use_f32_kernel = self.f32_layout
        # float32 rows quantized to int8 per group of 32 (int4_gemm_i8_f32): a quarter of the float
        # kernel's instructions a weight, which kept two AVX2 cores below the memory's rate
        layer.use_i8_f32_kernel = layer.use_f32_kernel and getattr(layer, "int8_inputs", True) \
            and self.config.int8_activations
        # inputs that int8 would flatten (the down projection's) as int16 up to a few rows instead:
        # ~1e-5 of each group's largest value from float32, 1.6x the float32 kernel's speed at one row
        layer.use_i16_f32_kernel = layer.use_f32_kernel and not layer.use_i8_f32_kernel \
            and self.config.int8_activations
        layer.torch_layout = not self.f32_layout  # PyTorch's own int4pack product reads it
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
    def f32_layout(self) -> bool:
        """Whether this config packs the float32 kernels' layout (int4_f32_layout.py), not the host's
        int4pack. Cached: embedding lookups read it every step."""
        return f32_kernels(self.config)

    @functools.cached_property
    def layout(self) -> Int4PackLayout:
        """The host's int4pack layout, which this config packs unless `f32_layout`."""
        layout = int4pack_layout()
        assert layout is not None, "storage_for never picks int4 without a known int4pack layout"
        return layout

    def _rows(self, layer: nn.Module, rows: Tensor) -> Tensor:
        """Dequantize selected output rows (see Int4PackLayout for where each code is)."""
        if self.f32_layout:
            codes, s, z = int4_f32_layout.rows_of(layer.qweight, rows)
            w = (codes.view(len(rows), -1, INT4_GROUP).float() - 8) * s.unsqueeze(-1) + z.unsqueeze(-1)
            return w.view(len(rows), -1)
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
        if self.f32_layout:
            codes, s, z = int4_f32_layout.unpack(layer.qweight)
            w = (codes.view(codes.shape[0], -1, INT4_GROUP).float() - 8) * s.unsqueeze(-1) + z.unsqueeze(-1)
            return w.view(codes.shape[0], -1)[:layer.out_rows]
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
                return matmul_ops.int4_gemm_i8_f32(x, layer.qweight, layer.out_rows)
            except library.KernelUnavailable:  # built without AVX2 + FMA: PyTorch's kernels from now on
                layer.use_f32_kernel = layer.use_i8_f32_kernel = False
        if 0 < rows <= bindings.INT4_I16_MAX_ROWS and layer.use_i16_f32_kernel:
            try:
                return matmul_ops.int4_gemm_i16_f32(x, layer.qweight, layer.out_rows)
            except library.KernelUnavailable:  # built without AVX2 + FMA: PyTorch's kernels from now on
                layer.use_f32_kernel = layer.use_i16_f32_kernel = False
        if rows <= bindings.INT4_F32_MAX_ROWS and layer.use_f32_kernel:
            try:
                return matmul_ops.int4_gemm_f32(x, layer.qweight, layer.out_rows)
            except library.KernelUnavailable:  # built without AVX2 + FMA: PyTorch's kernels from now on
                layer.use_f32_kernel = layer.use_i16_f32_kernel = False
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
        float32: the float32 layout of int4_gemm_f32 (scales within), up to its row limit as `apply`."""
        if not (layer.use_gemm_kernel or layer.use_f32_kernel):
            return None
        kind = (bindings.LINEAR_INT4_I8 if layer.use_i8_kernel or layer.use_i8_f32_kernel else
                bindings.LINEAR_INT4_I16 if layer.use_i16_f32_kernel else bindings.LINEAR_INT4)
        if self.f32_layout:
            t, g, _ = layer.qweight.shape
            scales, n_pad, k = 0, t * int4_f32_layout.TILE, g * INT4_GROUP
        else:
            sz = layer.scales_zeros
            scales, n_pad, k = sz.data_ptr(), sz.shape[1], sz.shape[0] * INT4_GROUP
        return bindings.LinearOperand(kind=kind, weight=layer.qweight.data_ptr(), scales=scales,
                                     n_pad=n_pad, n=layer.out_rows, k=k,
                                     max_rows=bindings.INT4_F32_MAX_ROWS
                                     if layer.use_f32_kernel and not layer.use_i8_f32_kernel else 0)

    def describe(self, layer):
        return ("int4" + ("" if layer.int4_exact else " (requantized)")
                + (" (int8 activations)" if layer.use_i8_kernel or layer.use_i8_f32_kernel else
                   " (int16 activations)" if layer.use_i16_f32_kernel else ""))


def quantize_int4(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Round a float [N, K] weight to asymmetric int4 groups of 32 (min/max per group)."""
    n, k = w.shape
    g = w.float().view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).view(n, k)
    return codes, scale, lo + 8.0 * scale
