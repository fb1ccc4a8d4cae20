"""The int4 layout of the float32 kernels (int4_avx2.c, int4_i8_f32.c): codes and their scales in
one stream.

Output rows in tiles of 32; a tile is its K/32 column groups one after another, 640 bytes each:
the 32 columns' codes, 16 bytes a column (byte c: row c in the low nibble, row 16 + c in the
high one, PyTorch's int4pack tile on AVX2 hosts), then the 32 rows' scales and their 32 zeros
as float16 (w = (q - 8) * s + z). Why not PyTorch's int4pack with [K/32, N, 2] float32 scales:
there a third of the bytes a decode step reads were scales, fetched from a second stream N * 8
bytes apart per group; beside their codes as halves they cost 0.125 bytes a weight instead of
0.25, and the int8-activation kernel at one row ran 1.32x faster on an AMD EPYC core. GGUF's
Q4_0 and Q4_1 keep their scales as halves too (Q4_1's zero, m + 8 d, is rounded to one).
"""
from __future__ import annotations

import torch
from torch import Tensor

TILE = 32
GROUP = 32
CODE_BYTES = GROUP * TILE // 2  # 512
GROUP_BYTES = CODE_BYTES + 2 * TILE * 2  # 640: codes, then 32 scales and 32 zeros as halves


def storage_bytes(padded_rows: int, cols: int) -> int:
    return padded_rows // TILE * (cols // GROUP) * GROUP_BYTES


def pack(codes: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """[N, K] codes (0..15, N a multiple of 32) with their [N, K/32] scales and zeros ->
    [N/32, K/32, 640] uint8."""
    n, k = codes.shape
    t, g = n // TILE, k // GROUP
    tiles = codes.to(torch.uint8).view(t, TILE, k)
    pairs = tiles[:, :16] | (tiles[:, 16:] << 4)  # [T, 16, K]: byte c of each column
    code_bytes = pairs.transpose(1, 2).reshape(t, g, CODE_BYTES)
    halves = torch.cat([scale.reshape(t, TILE, g), zero.reshape(t, TILE, g)], dim=1).transpose(1, 2)  # [T, G, 64]
    return torch.cat([code_bytes, halves.to(torch.float16).contiguous().view(torch.uint8)], dim=2).contiguous()


def unpack(packed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`pack`'s inverse: ([N, K] codes, [N, K/32] scales, [N, K/32] zeros as float32)."""
    t, g, _ = packed.shape
    col = packed[..., :CODE_BYTES].reshape(t, g, GROUP, 16)  # [T, G, column, byte]
    codes = torch.cat([col & 15, col >> 4], dim=3)  # [T, G, column, row]
    codes = codes.permute(0, 3, 1, 2).reshape(t * TILE, g * GROUP)
    halves = packed[..., CODE_BYTES:].contiguous().view(torch.float16).float()  # [T, G, 64]
    scale = halves[..., :TILE].permute(0, 2, 1).reshape(t * TILE, g)
    zero = halves[..., TILE:].permute(0, 2, 1).reshape(t * TILE, g)
    return codes, scale, zero


def rows_of(packed: Tensor, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`unpack` of selected rows only (embedding lookups): ([R, K] codes, [R, K/32] scales, zeros)."""
    t, g, _ = packed.shape
    sel = packed[rows // TILE]  # [R, G, 640]
    r = (rows % TILE).view(-1, 1, 1)
    col = sel[..., :CODE_BYTES].reshape(len(rows), g, GROUP, 16)
    byte = col.gather(3, (r % 16).unsqueeze(-1).expand(-1, g, GROUP, 1)).squeeze(-1)  # [R, G, column]
    codes = torch.where(r < 16, byte & 15, byte >> 4).reshape(len(rows), g * GROUP)
    halves = sel[..., CODE_BYTES:].contiguous().view(torch.float16).float()  # [R, G, 64]
    scale = halves.gather(2, r.expand(-1, g, 1)).squeeze(-1)
    zero = halves.gather(2, (r + TILE).expand(-1, g, 1)).squeeze(-1)
    return codes, scale, zero
