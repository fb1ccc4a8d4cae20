"""The Attention layer: hands q/k/v and this layer's cache to the step's backend.

Models stay backend-agnostic: the backend travels in the step's metadata, so
the same model runs on the reference loop, the SDPA backend or any other.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from tessera.attention.base import AttentionMetadata, KeyBias


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: Optional[int] = None, causal: bool = True, softcap: Optional[float] = None):
        """`causal=False`: an encoder's attention (every token sees its whole request; no KV
        cache, see AttentionBackend.forward_bidirectional). `softcap`: scores soft-capped (Gemma 2)."""
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.causal = causal
        self.softcap = softcap

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Optional[Tensor], meta: AttentionMetadata,
                key_bias: Optional[KeyBias] = None, sinks: Optional[Tensor] = None) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (after RoPE) -> [T, Hq * D]. `key_bias`: the keys' share that
        came from a key bias (attention/base.py's KeyBias), which a quantized cache keeps out of its
        rounding; models with a key bias pass it, other caches ignore it. `sinks`: float32 [Hq], the
        layer's learned attention sinks (gpt-oss; AttentionBackend.forward), passed by the model on
        each call because they are its loaded weights, not a constant of the layer's shape. Optional
        arguments reach the backend only when set, so a backend without them still serves the models
        that do not use them. `kv_cache` is unused (None) for a bidirectional layer."""
        if not self.causal:
            if sinks is not None:
                raise ValueError("attention sinks are for causal layers; bidirectional attention takes none")
            return meta.backend.forward_bidirectional(q, k, v, meta, self.scale)
        key_bias = key_bias if meta.backend.quantized else None
        extra = {}
        if self.softcap is not None:
            extra["softcap"] = self.softcap
        if sinks is not None:
            extra["sinks"] = sinks
        return meta.backend.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window, key_bias, **extra)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
                + (f", window={self.sliding_window}" if self.sliding_window else "")
                + (f", softcap={self.softcap}" if self.softcap else "")
                + ("" if self.causal else ", bidirectional"))
