"""Rotary position embedding from a precomputed cos/sin table, as in HF's neox (half-split) form.

The table is built once (and grown on demand) so a step only gathers rows for
its positions; Q and K heads rotate together in one addcmul.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor, nn

from tessera.errors import ModelFormatError

_INITIAL_ROPE_POSITIONS = 4096


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Optional[dict[str, Any]], max_positions: int,
) -> tuple[Tensor, float]:
    """Inverse frequencies and cos/sin scale for a RoPE base and optional scaling.

    Scaled variants are computed by transformers' own ROPE_INIT_FUNCTIONS so they
    match the reference implementation exactly.
    """
    kind = rope_kind(scaling)
    if kind == "default":
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)), 1.0
    if kind == "longrope":
        return _longrope(head_dim, theta, scaling, max_positions, "short_factor")
    if kind not in ("linear", "llama3", "yarn"):
        raise ModelFormatError(f"RoPE scaling type {kind!r} is not supported (linear, llama3, yarn and longrope are)")
    from transformers.models.llama.configuration_llama import LlamaConfig  # the module: thread-safe to import
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {k: v for k, v in scaling.items() if k != "type"}
    params.update(rope_type=kind, rope_theta=theta)
    hf_config = LlamaConfig(
        hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
        max_position_embeddings=max_positions, rope_parameters=params,
    )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
    return inv_freq.float(), float(attention_scaling)


def rope_kind(scaling: Optional[dict[str, Any]]) -> str:
    return (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"


def _longrope(head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int,
              which: str) -> tuple[Tensor, float]:
    """LongRoPE (Phi-3): each frequency divided by its own factor, the short factors' up to the
    pretraining length and the long ones' past it; cos/sin scaled by one attention factor. As
    transformers computes it (modeling_rope_utils._compute_longrope_parameters)."""
    factors = scaling.get(which)
    original = scaling.get("original_max_position_embeddings")
    if not isinstance(factors, list) or len(factors) != head_dim // 2 or not original:
        raise ModelFormatError(f"LongRoPE needs {head_dim // 2} {which} values and "
                               "original_max_position_embeddings")
    factor = scaling.get("factor") or max_positions / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** shape), float(attention)


class RotaryEmbedding(nn.Module):
    """cos/sin table for one RoPE base, laid out for the rotate-by-roll form.

    Row p of `cos` is [cos(p*f), cos(p*f)] and of `sin` is [-sin(p*f), sin(p*f)],
    so `x*cos + roll(x, D/2)*sin` equals the usual `x*cos + rotate_half(x)*sin`.
    The table grows on demand past its initial size. `head_dim` is the rotated part of a head
    (less than the head with partial rotary, see apply_rope). LongRoPE has two sets of
    frequencies: the short factors' (the default) and the long ones', which `use_long_factors`
    switches to for every position of every sequence (see its docstring).
    """

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict[str, Any]], max_positions: int,
                 dtype: torch.dtype, freq_factors: Optional[Tensor] = None):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(head_dim, theta, scaling, max_positions)
        if freq_factors is not None:  # llama3-style rope_freqs tensor from a GGUF file
            inv_freq = inv_freq / freq_factors.float()
        self.inv_freq = inv_freq
        self.long_inv_freq: Optional[Tensor] = None
        self.short_inv_freq: Optional[Tensor] = None
        self.original_max_positions = 0
        if rope_kind(scaling) == "longrope":
            self.short_inv_freq = inv_freq
            self.long_inv_freq = _longrope(head_dim, theta, scaling, max_positions, "long_factor")[0]
            self.original_max_positions = int(scaling["original_max_position_embeddings"])
        self.half = head_dim // 2
        self.dtype = dtype
        self.max_positions = max_positions
        self._build(min(max_positions, _INITIAL_ROPE_POSITIONS))
        self._exact: Optional[tuple[Tensor, Tensor]] = None

    def _build(self, n: int) -> None:
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq)
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        device = self.cos.device if hasattr(self, "cos") else torch.device("cpu")
        self.cos = torch.cat([cos, cos], dim=-1).to(self.dtype).to(device)
        self.sin = torch.cat([-sin, sin], dim=-1).to(self.dtype).to(device)

    def use_long_factors(self, max_model_len: int) -> bool:
        """LongRoPE: the long factors for every position when sequences may grow past the
        pretraining length, else the short ones (True when long). One set for the whole context,
        as llama.cpp (by its context size) and vLLM choose: keys cached early stay valid as a
        sequence grows and two sequences' shared prefix is the same in both. transformers instead
        recomputes a sequence with the long factors once it passes that length."""
        if self.long_inv_freq is None:
            return False
        long = max_model_len > self.original_max_positions
        inv_freq = self.long_inv_freq if long else self.short_inv_freq
        if not torch.equal(inv_freq, self.inv_freq):
            self.inv_freq = inv_freq
            self._build(self.cos.shape[0])
            self._exact = None
        return long

    def exact_cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [T, D/2] float32 of each pair's angle at `positions`, from float64 angles and
        without the attention scaling: what an int8 KV cache takes out of Qwen2's keys as their
        key bias's share (attention/base.py's KeyBias), the same at any position (float32 angles
        drift by 1e-4 rad at 2,000 tokens). A table built on first use, grown on demand."""
        n = int(positions.max()) + 1 if positions.numel() else 0
        if self._exact is None or self._exact[0].shape[0] < n:
            have = 0 if self._exact is None else self._exact[0].shape[0]
            size = max(n, 2 * have, min(self.max_positions, _INITIAL_ROPE_POSITIONS))
            angles = torch.arange(size, dtype=torch.float64).unsqueeze(1) * self.inv_freq.double()
            self._exact = (angles.cos().float(), angles.sin().float())
        return self._exact[0][positions], self._exact[1][positions]

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """[T] positions -> cos, sin of shape [T, 1, D] (broadcast over heads). The tables follow
        the positions' device: on a GPU built whole (every position the model takes) when first
        used there, so no step reads the positions back to the host to grow them."""
        if self.cos.device != positions.device:
            if positions.device.type != "cpu":
                self._build(self.max_positions)
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        if positions.is_cpu and positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            self._build(max(int(positions.max()) + 1, 2 * self.cos.shape[0]))
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, half: int) -> Tensor:
    """Rotate [T, H, D] by the gathered [T, 1, R] tables (neox / half-split layout); with partial
    rotary (R < D) the first R dimensions of each head rotate and the rest pass through."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(half, dims=-1), sin)
    head = x[..., :rotary]
    return torch.cat([torch.addcmul(head * cos, head.roll(half, dims=-1), sin), x[..., rotary:]], dim=-1)

