"""The Attention layer: hands q/k/v and this layer's cache to the step's backend.

Models stay backend-agnostic: the backend travels in the step's metadata, so
the same model runs on the reference loop, the SDPA backend or any other.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from tessera.attention.base import AttentionMetadata, Smoothing


MAX_KEY_DIVISOR = 16.0


def key_smoothing_from_bias(k_bias: Tensor, num_kv_heads: int, head_dim: int) -> Tensor:
    """Per-channel divisors [Hkv, D] for keys bound for a quantized cache, from a key bias.

    Qwen2's key bias puts a few channels at 20-40x the others (measured: layer 8 of
    qwen2.5-coder-0.5b, 217 against a median of 5.4), and after RoPE a channel pair carries the
    pair's bias norm at every position. Dividing those channels by (pair norm / its median, at most
    MAX_KEY_DIVISOR) before rounding, and multiplying the queries' channels by the same amounts,
    leaves every q.k as it was while the block scales stop being set by a handful of channels: the
    int8 cache's perplexity cost on that model went from +5.8 % to between -0.02 and +1.5 %
    (benchmarks/kv_cache_dtype.py; +0.7 % uncapped). The cap bounds a channel's rounding error,
    multiplied back by its divisor (up to 540 on qwen2.5-coder-1.5b's first layer, where neither
    capped nor uncapped smoothing helps: benchmarks/README.md).
    """
    b = k_bias.detach().float().view(num_kv_heads, head_dim)
    half = head_dim // 2
    pair = torch.sqrt(b[:, :half] ** 2 + b[:, half:2 * half] ** 2)
    pair = torch.cat([pair, pair, b[:, 2 * half:].abs()], dim=1)  # an odd last channel stands alone
    typical = pair.median(dim=1, keepdim=True).values.clamp_min(1e-6)
    return (pair / typical).clamp(1.0, MAX_KEY_DIVISOR)


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: Optional[int] = None):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        # (query multipliers [Hq, D], key multipliers [Hkv, D]) for a quantized cache, float32.
        self._smoothing: Optional[Smoothing] = None

    def set_key_smoothing(self, divisors: Tensor) -> None:
        """Keys are divided and queries multiplied by `divisors` [Hkv, D] when the cache is quantized:
        q.k is unchanged, the keys' channels are evened out before rounding."""
        group = self.num_heads // self.num_kv_heads
        self._smoothing = (divisors.repeat_interleave(group, dim=0).float().contiguous(),
                           (1.0 / divisors).float().contiguous())

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]."""
        smoothing = self._smoothing if meta.backend.quantized else None
        return meta.backend.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window, smoothing)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
                + (f", window={self.sliding_window}" if self.sliding_window else ""))
