"""Weights as they come out of a checkpoint, before a quantization method stores them.

A loader yields each tensor either as a plain float tensor (safetensors, GGUF
F32/F16/BF16) or as a `GGUFWeight`: the raw blocks of a quantized GGUF tensor,
kept undecoded so that a method can take them over exactly (a Q4_1 block's
4-bit codes, scale and minimum become an int4 group as they are, with no
re-rounding). Every source can also be dequantized to float32, which is what
the dense method and any requantization start from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Protocol, Union

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

Q = GGMLQuantizationType
# Types whose blocks map exactly onto int4 groups of 32 with a scale and a zero point.
INT4_EXACT_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
# GGUF types a loader hands over as float tensors.
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
# "Precision class" of GGUF types, used by --quantization auto.
FOUR_BIT_OR_LESS = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q2_K, Q.Q3_K, Q.MXFP4})
FIVE_TO_EIGHT_BIT = frozenset({Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0})
# Types whose blocks map exactly onto int8 codes with a float32 scale (and, if asymmetric, a
# zero) per group of consecutive values along a row: (group size, has zeros).
INT8_GROUPS = {Q.Q8_0: (32, False), Q.Q5_0: (32, False), Q.Q6_K: (16, False), Q.Q5_1: (32, True),
               Q.Q5_K: (32, True)}
_DEQUANT_CHUNK = 1 << 20  # values per gguf dequantize call (cache-sized temporaries are 4-6x faster)


class WeightSource(Protocol):
    """A 2-D (or 1-D) weight in some storage format, [out_features, in_features]."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def dequantize(self) -> torch.Tensor:
        """The weight as float32."""

    def row_chunks(self, rows: int) -> Iterator[torch.Tensor]:
        """The weight as float32, `rows` rows at a time (bounded temporary memory)."""


@dataclass
class FloatWeight:
    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def dequantize(self) -> torch.Tensor:
        return self.tensor.float()

    def row_chunks(self, rows: int) -> Iterator[torch.Tensor]:
        for i in range(0, self.tensor.shape[0], rows):
            yield self.tensor[i:i + rows].float()


@dataclass
class GGUFWeight:
    """Raw blocks of a quantized GGUF matrix: `raw` is [rows, bytes_per_row] uint8.

    A 3-D GGUF tensor (MoE experts, [n_expert, rows, cols]) comes as one matrix of all experts'
    rows, `experts` saying how many it stacks; `expert(e)` is one expert's matrix, a view of the
    same bytes (of the memory-mapped file, as the loader hands them over)."""

    raw: np.ndarray
    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]
    experts: int = 1

    def expert(self, e: int) -> "GGUFWeight":
        """Expert e's [rows / experts, cols] matrix, its blocks a view (no copy)."""
        n = self.shape[0] // self.experts
        return GGUFWeight(self.raw[e * n:(e + 1) * n], self.ggml_type, (n, self.shape[1]))

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.shape
        out = np.empty((rows, cols), dtype=np.float32)
        step = max(1, _DEQUANT_CHUNK // cols)
        for i in range(0, rows, step):
            out[i:i + step] = gguf_dequantize(self.raw[i:i + step], self.ggml_type)
        return torch.from_numpy(out)

    def row_chunks(self, rows: int) -> Iterator[torch.Tensor]:
        for i in range(0, self.shape[0], rows):
            yield torch.from_numpy(gguf_dequantize(self.raw[i:i + rows], self.ggml_type).reshape(-1, self.shape[1]))

    def permute_rows(self, order: np.ndarray) -> "GGUFWeight":
        """Rows reordered (blocks never cross rows, so this is exact)."""
        return GGUFWeight(np.ascontiguousarray(self.raw[order]), self.ggml_type, self.shape, self.experts)

    @property
    def int4_exact(self) -> bool:
        """Whether the blocks map exactly onto int4 groups (see int4_groups)."""
        return self.ggml_type in INT4_EXACT_TYPES

    def int4_groups(self) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(codes uint8 [N, K] in 0..15, scale f32 [N, K/32], zero f32 [N, K/32]) with
        `w = (code - 8) * scale + zero` exactly, or None if this type has no such form."""
        if self.ggml_type not in INT4_EXACT_TYPES:
            return None
        n, k = self.shape
        block, nbytes = GGML_QUANT_SIZES[self.ggml_type]
        blocks = self.raw.reshape(n, k // block, nbytes)
        if self.ggml_type in (Q.Q4_0, Q.Q4_1):
            d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
            off = 2 if self.ggml_type == Q.Q4_0 else 4
            qs = blocks[..., off:off + 16]  # value j: low nibble of byte j; value j + 16: high nibble
            codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [N, K/32, 32]
            if self.ggml_type == Q.Q4_0:
                zero = np.zeros_like(d)  # w = d * (code - 8)
            else:
                m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
                zero = m + 8.0 * d  # w = d * code + m
            scale = d
        else:  # Q4_K: 256 values in 8 sub-blocks of 32, 6-bit sub-scales and sub-minimums
            d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]
            dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]
            sc, mn = _k_scales_mins(blocks[..., 4:16].astype(np.uint8))
            qs = blocks[..., 16:144].reshape(n, k // block, 4, 32)  # four 64-value chunks
            # Chunk i holds sub-block 2i in its low nibbles and 2i + 1 in its high nibbles.
            codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k // block * 8, 32)
            scale = (d * sc).reshape(n, -1)  # w = d * sc * code - dmin * m
            zero = (-(dmin * mn)).reshape(n, -1) + 8.0 * scale
        return (torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k))),
                torch.from_numpy(np.ascontiguousarray(scale.reshape(n, -1))),
                torch.from_numpy(np.ascontiguousarray(zero.reshape(n, -1))))


    def int8_groups(self) -> Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
        """(codes int8 [N, K], scale f32 [N, K/G], zero f32 [N, K/G] or None) with
        `w = code * scale + zero` exactly, G as INT8_GROUPS says, or None if this type has no
        such form. Scales and zeros come from the blocks' headers; the codes are recovered from
        gguf's dequantized values, which are exact products of them (at most 23 significant bits).
        Callers convert a large matrix a slice of rows at a time (the float32 copy is temporary)."""
        if self.ggml_type not in INT8_GROUPS:
            return None
        group, _ = INT8_GROUPS[self.ggml_type]
        n, k = self.shape
        block, nbytes = GGML_QUANT_SIZES[self.ggml_type]
        blocks = self.raw.reshape(n, k // block, nbytes)

        def f16(lo: int) -> np.ndarray:
            return blocks[..., lo:lo + 2].copy().view(np.float16)[..., 0].astype(np.float32)

        zero: Optional[np.ndarray] = None
        if self.ggml_type in (Q.Q8_0, Q.Q5_0):  # w = d * q, q signed (Q5_0: its 5-bit code - 16)
            scale = f16(0)
        elif self.ggml_type == Q.Q5_1:  # w = d * q + m, q in 0..31
            scale, zero = f16(0), f16(2)
        elif self.ggml_type == Q.Q6_K:  # 16 sub-blocks of 16: w = d * sc[j] * q, q in -32..31
            sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
            scale = (f16(208)[..., None] * sc).reshape(n, -1)
        else:  # Q5_K: 8 sub-blocks of 32 with 6-bit scales and minimums, as Q4_K packs them
            sc_bytes = blocks[..., 4:16].astype(np.uint8)
            sc, mn = _k_scales_mins(sc_bytes)
            scale = (f16(0)[..., None] * sc).reshape(n, -1)
            zero = (-(f16(2)[..., None] * mn)).reshape(n, -1)
        g = self.dequantize().numpy().reshape(n, k // group, group)
        shifted = g - zero[..., None] if zero is not None else g
        safe = np.where(scale == 0, 1.0, scale)[..., None]
        codes = np.where(scale[..., None] == 0, 0.0, np.rint(shifted / safe))
        return (torch.from_numpy(codes.reshape(n, k).astype(np.int8)),
                torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
                None if zero is None else torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32)))


    def q6k_blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A Q6_K matrix in the layout tessera/kernels/kquant_gemm.c reads, the same values:
        (codes uint8 [N, K/256 * 192], sub-block scales int8 [N, K/16], d float32 [N, K/256]) with
        w = d * sc[j / 16] * (code_j - 32). Each super-block's 192 bytes: byte p (p < 64) holds the
        low nibbles of codes p and 64 + p, byte 64 + p those of 128 + p and 192 + p, byte 128 + p
        the top two bits of all four (see the kernel)."""
        assert self.ggml_type == Q.Q6_K
        n, k = self.shape
        nb = k // 256
        blocks = self.raw.reshape(n, nb, 210)
        ql, qh = blocks[..., 0:128].reshape(n, nb, 2, 64), blocks[..., 128:192].reshape(n, nb, 2, 32)
        # The file's order: half h (128 values) takes ql[h] and qh[h]; value 128h + 32i + l of
        # quarter i (0..3) is the low (i < 2) or high nibble of ql[h][l + 32 (i % 2)] with the two
        # bits 2i..2i+1 of qh[h][l] on top.
        codes = np.empty((n, nb, 256), dtype=np.uint8)
        for h in range(2):
            for i in range(4):
                low = ql[:, :, h, 32 * (i % 2):32 * (i % 2) + 32]
                low = (low & 0x0F) if i < 2 else (low >> 4)
                codes[:, :, 128 * h + 32 * i:128 * h + 32 * i + 32] = low | (((qh[:, :, h] >> (2 * i)) & 3) << 4)
        c = [codes[..., 64 * j:64 * j + 64] for j in range(4)]
        packed = np.concatenate([(c[0] & 0x0F) | ((c[1] & 0x0F) << 4), (c[2] & 0x0F) | ((c[3] & 0x0F) << 4),
                                 (c[0] >> 4) | ((c[1] >> 4) << 2) | ((c[2] >> 4) << 4) | ((c[3] >> 4) << 6)],
                                axis=-1)
        sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(n, nb * 16)
        d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
        return (torch.from_numpy(np.ascontiguousarray(packed.reshape(n, nb * 192))),
                torch.from_numpy(np.ascontiguousarray(sc)), torch.from_numpy(np.ascontiguousarray(d)))


    def q4k_blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A Q4_K matrix in the layout tessera/kernels/kquant_gemm.c reads, the same values:
        (codes uint8 [N, K/256 * 128], scales then minimums uint8 [N, K/256 * 16], (d, dmin)
        float32 [N, K/256, 2]) with w = d * sc[j / 32] * code_j - dmin * mn[j / 32]. Byte p
        (p < 64) of a super-block holds codes p and 64 + p, byte 64 + p codes 128 + p and 192 + p."""
        assert self.ggml_type == Q.Q4_K
        n, k = self.shape
        nb = k // 256
        blocks = self.raw.reshape(n, nb, 144)
        # The file's order: 64-value chunk i holds sub-block 2i in the low nibbles of its 32
        # bytes and 2i + 1 in the high ones.
        qs = blocks[..., 16:144].reshape(n, nb, 4, 32)
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, nb, 256)
        c = [codes[..., 64 * j:64 * j + 64] for j in range(4)]
        packed = np.concatenate([c[0] | (c[1] << 4), c[2] | (c[3] << 4)], axis=-1)
        sc, mn = _k_scales_mins(blocks[..., 4:16].astype(np.uint8))
        scale_min = np.concatenate([sc, mn], axis=-1).astype(np.uint8)
        dm = blocks[..., 0:4].copy().view(np.float16).astype(np.float32)  # [N, NB, 2]: d, dmin
        return (torch.from_numpy(np.ascontiguousarray(packed.reshape(n, nb * 128))),
                torch.from_numpy(np.ascontiguousarray(scale_min.reshape(n, nb * 16))),
                torch.from_numpy(np.ascontiguousarray(dm)))


def _k_scales_mins(sc_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, minimum) pairs of a Q4_K / Q5_K block's 12 scale bytes."""
    shape = sc_bytes.shape[:-1] + (8,)
    sc, mn = np.empty(shape, dtype=np.float32), np.empty(shape, dtype=np.float32)
    for j in range(8):
        if j < 4:
            s, m = sc_bytes[..., j] & 63, sc_bytes[..., j + 4] & 63
        else:
            s = (sc_bytes[..., j + 4] & 0x0F) | ((sc_bytes[..., j - 4] >> 6) << 4)
            m = (sc_bytes[..., j + 4] >> 4) | ((sc_bytes[..., j] >> 6) << 4)
        sc[..., j], mn[..., j] = s, m
    return sc, mn


AnyWeight = Union[FloatWeight, GGUFWeight]


def as_source(w: Union[torch.Tensor, AnyWeight]) -> AnyWeight:
    return FloatWeight(w) if isinstance(w, torch.Tensor) else w


def mxfp4_from_blocks(blocks: np.ndarray, scales: np.ndarray) -> GGUFWeight:
    """Hugging Face's MXFP4 tensors (gpt-oss's `*_blocks` uint8 [..., rows, K/32, 16] and
    `*_scales` uint8 [..., rows, K/32], the OCP microscaling layout) as GGUF MXFP4 blocks over the
    same values, leading dimensions stacked as rows. Both store a 32-value block as one E8M0
    exponent and sixteen bytes of E2M1 codes; OCP pairs values 2j, 2j + 1 in byte j's low and
    high nibbles, ggml pairs values j, j + 16 (what llama.cpp's converter rearranges too)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair")
    codes = np.empty(blocks.shape[:-1] + (32,), dtype=np.uint8)
    codes[..., 0::2], codes[..., 1::2] = blocks & 0x0F, blocks >> 4
    packed = np.concatenate([scales[..., None], codes[..., :16] | (codes[..., 16:] << 4)], axis=-1)
    rows, groups = int(np.prod(blocks.shape[:-2])), blocks.shape[-2]
    return GGUFWeight(np.ascontiguousarray(packed.reshape(rows, groups * 17)), Q.MXFP4, (rows, groups * 32))
