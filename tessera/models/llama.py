"""Llama-family decoder (llama, qwen2) over Tessera's packed batch and paged KV cache.

Written for batch-1 speed on CPU, where a small model pays per-op overhead
as much as FLOPs: Q, K and V are one Linear, gate and up are one
Linear, and RoPE rotates Q and K together in one go with cos/sin rows gathered
once per step from a precomputed table. Everything here runs without autograd.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.config import ModelConfig
from tessera.engine.attention import AttentionMetadata, paged_attention
from tessera.errors import ModelFormatError

_INITIAL_ROPE_POSITIONS = 4096


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Optional[dict[str, Any]], max_positions: int,
) -> tuple[Tensor, float]:
    """Inverse frequencies and cos/sin scale for a RoPE base and optional scaling.

    Scaled variants are computed by transformers' own ROPE_INIT_FUNCTIONS so they
    match the reference implementation exactly.
    """
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)), 1.0
    if kind not in ("linear", "llama3", "yarn"):
        raise ModelFormatError(f"RoPE scaling type {kind!r} is not supported (linear, llama3 and yarn are)")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {k: v for k, v in scaling.items() if k != "type"}
    params.update(rope_type=kind, rope_theta=theta)
    hf_config = LlamaConfig(
        hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
        max_position_embeddings=max_positions, rope_parameters=params,
    )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
    return inv_freq.float(), float(attention_scaling)


class Rope(nn.Module):
    """cos/sin table for one RoPE base, laid out for the rotate-by-roll form.

    Row p of `cos` is [cos(p*f), cos(p*f)] and of `sin` is [-sin(p*f), sin(p*f)],
    so `x*cos + roll(x, D/2)*sin` equals the usual `x*cos + rotate_half(x)*sin`.
    The table grows on demand past its initial size.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict[str, Any]], max_positions: int,
                 dtype: torch.dtype, freq_factors: Optional[Tensor] = None):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(head_dim, theta, scaling, max_positions)
        if freq_factors is not None:  # llama3-style rope_freqs tensor from a GGUF file
            inv_freq = inv_freq / freq_factors.float()
        self.inv_freq = inv_freq
        self.half = head_dim // 2
        self.dtype = dtype
        self.max_positions = max_positions
        self._build(min(max_positions, _INITIAL_ROPE_POSITIONS))

    def _build(self, n: int) -> None:
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq)
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        self.cos = torch.cat([cos, cos], dim=-1).to(self.dtype)
        self.sin = torch.cat([-sin, sin], dim=-1).to(self.dtype)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """[T] positions -> cos, sin of shape [T, 1, D] (broadcast over heads)."""
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            self._build(max(int(positions.max()) + 1, 2 * self.cos.shape[0]))
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, half: int) -> Tensor:
    """Rotate [T, H, D] by the gathered [T, 1, D] tables (neox / half-split layout)."""
    return torch.addcmul(x * cos, x.roll(half, dims=-1), sin)


def set_param(module: nn.Module, attr: str, value: Tensor, name: str) -> None:
    """Replace a placeholder parameter by `value` in the placeholder's dtype, checking its shape."""
    want = getattr(module, attr)
    if tuple(value.shape) != tuple(want.shape):
        raise ModelFormatError(
            f"weight {name} has shape {tuple(value.shape)} but the config implies {tuple(want.shape)}; "
            "the file's metadata and tensors disagree"
        )
    setattr(module, attr, nn.Parameter(value.to(want.dtype).contiguous(), requires_grad=False))


def collect_layer_weights(
    weights: Iterable[tuple[str, Tensor]], num_layers: int, parts: list[str], set_layer,
    tie_word_embeddings: bool, source: str,
) -> dict[str, Tensor]:
    """Hand each layer's tensors to `set_layer(idx, parts)` as soon as the layer is complete,
    so dequantized copies never pile up; return the other tensors; raise if any is missing."""
    pending: list[dict[str, Tensor]] = [{} for _ in range(num_layers)]
    done = [False] * num_layers
    globals_: dict[str, Tensor] = {}
    for name, tensor in weights:
        if name.startswith("model.layers."):
            idx_str, _, part = name[len("model.layers."):].partition(".")
            idx = int(idx_str)
            if idx >= num_layers or part not in parts:
                continue
            pending[idx][part] = tensor
            if len(pending[idx]) == len(parts):
                set_layer(idx, pending[idx])
                pending[idx], done[idx] = {}, True
        else:
            globals_[name] = tensor
    missing = [f"model.layers.{i}.{p}" for i in range(num_layers) if not done[i]
               for p in parts if p not in pending[i]]
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        if name not in globals_:
            missing.append(name)
    if not tie_word_embeddings and "lm_head.weight" not in globals_:
        missing.append("lm_head.weight")
    if missing:
        raise ModelFormatError(
            f"{source} is missing {len(missing)} weight(s), e.g. {missing[0]}; the file is incomplete or "
            "not a standard checkpoint"
        )
    return globals_


def fuse_rows(parts: dict[str, Tensor], *names: str, prefix: str) -> Tensor:
    """Concatenate along rows, with a clear error if the pieces do not fit together."""
    try:
        return torch.cat([parts[n] for n in names])
    except RuntimeError:
        shapes = ", ".join(f"{n}={tuple(parts[n].shape)}" for n in names)
        raise ModelFormatError(f"{prefix}: tensors cannot be fused ({shapes}); the file is inconsistent") from None


class LlamaForCausalLM(nn.Module):
    """Decoder for `llama` and `qwen2` checkpoints (qwen2 adds a QKV bias)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        c = config
        self.config = c
        self.dtype = dtype
        self.hidden = c.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.eps = c.rms_norm_eps
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.num_layers = c.num_layers

        def param(*shape: int) -> nn.Parameter:  # placeholder; load_weights assigns the real tensor
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"), requires_grad=False)

        self.embed_tokens = param(c.vocab_size, c.hidden_size)
        self.lm_head = self.embed_tokens if c.tie_word_embeddings else param(c.vocab_size, c.hidden_size)
        self.norm = param(c.hidden_size)
        qkv_out = self.q_size + 2 * self.kv_size
        self.layers = nn.ModuleList()
        for _ in range(c.num_layers):
            layer = nn.Module()
            layer.input_norm = param(c.hidden_size)
            layer.qkv = param(qkv_out, c.hidden_size)
            layer.qkv_bias = param(qkv_out) if c.attention_bias else None
            layer.o_proj = param(c.hidden_size, self.q_size)
            layer.post_norm = param(c.hidden_size)
            layer.gate_up = param(2 * c.intermediate_size, c.hidden_size)
            layer.down = param(c.hidden_size, c.intermediate_size)
            self.layers.append(layer)
        self.rope: Optional[Rope] = None  # built in load_weights (a GGUF may carry rope_freqs)

    # -- loading -------------------------------------------------------------
    LAYER_PARTS = [
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
        "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    ]
    BIAS_PARTS = ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]], source: str = "checkpoint") -> None:
        """Fuse and cast HF-named float tensors into this module, one layer at a time."""
        parts = self.LAYER_PARTS + (self.BIAS_PARTS if self.config.attention_bias else [])
        globals_ = collect_layer_weights(weights, self.num_layers, parts, self._set_layer,
                                         self.config.tie_word_embeddings, source)
        set_param(self, "embed_tokens", globals_.pop("model.embed_tokens.weight"), "model.embed_tokens.weight")
        if self.config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            set_param(self, "lm_head", globals_.pop("lm_head.weight"), "lm_head.weight")
        set_param(self, "norm", globals_.pop("model.norm.weight"), "model.norm.weight")
        self._build_rope(globals_.get("rope_freqs"))

    def _build_rope(self, freq_factors: Optional[Tensor]) -> None:
        c = self.config
        self.rope = Rope(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings,
                         self.dtype, freq_factors)

    def _set_layer(self, idx: int, p: dict[str, Tensor]) -> None:
        layer, pre = self.layers[idx], f"model.layers.{idx}."
        set_param(layer, "qkv", fuse_rows(p, "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                     "self_attn.v_proj.weight", prefix=pre), pre + "self_attn.q/k/v_proj.weight")
        if layer.qkv_bias is not None:
            set_param(layer, "qkv_bias", fuse_rows(p, "self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                              "self_attn.v_proj.bias", prefix=pre), pre + "self_attn.q/k/v_proj.bias")
        set_param(layer, "gate_up", fuse_rows(p, "mlp.gate_proj.weight", "mlp.up_proj.weight", prefix=pre),
                  pre + "mlp.gate/up_proj.weight")
        for attr, src in (("o_proj", "self_attn.o_proj.weight"), ("down", "mlp.down_proj.weight"),
                          ("input_norm", "input_layernorm.weight"), ("post_norm", "post_attention_layernorm.weight")):
            set_param(layer, attr, p[src], pre + src)

    # -- running -------------------------------------------------------------
    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor],
                attn_meta: AttentionMetadata) -> Tensor:
        h_size, eps = (self.hidden,), self.eps
        qk_end = self.q_size + self.kv_size
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        t = input_ids.shape[0]
        cos, sin = self.rope(positions)
        half = self.rope.half
        x = F.embedding(input_ids, self.embed_tokens)
        for layer, cache in zip(self.layers, kv_caches):
            h = F.rms_norm(x, h_size, layer.input_norm, eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            qk = apply_rope(qkv[:, :qk_end].view(t, nq + nkv, d), cos, sin, half)
            v = qkv[:, qk_end:].view(t, nkv, d)
            a = paged_attention(qk[:, :nq], qk[:, nq:], v, cache, attn_meta, self.scale)
            x = x + F.linear(a, layer.o_proj)
            h = F.rms_norm(x, h_size, layer.post_norm, eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return F.rms_norm(x, h_size, self.norm, eps)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.lm_head).float()
