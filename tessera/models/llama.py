"""Llama-family decoder (llama, qwen2) built from tessera.layers.

Module names follow Hugging Face (model.layers.N.self_attn.qkv_proj, ...), with
Q/K/V and gate/up fused into one Linear each: on CPU a small model pays per-op
overhead as much as FLOPs, so fewer, larger matrix products win. RoPE rotates
Q and K together from a table gathered once per step.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from tessera.attention.base import AttentionMetadata, KeyBias
from tessera.config import ModelConfig
from tessera.layers import Attention, GatedMLP, Linear, QuantConfig, RMSNorm, RotaryEmbedding, VocabEmbedding, apply_rope
from tessera.layers.weights import AnyWeight
from tessera.models.base import ExecutionPath, ModelBase
from tessera.models.fused_decode import DecoderLayerParts, DecoderParts, FusedDecode
from tessera.models.weights import load_named_weights, as_float_tensor


class LlamaAttention(nn.Module):
    def __init__(self, c: ModelConfig, quant: QuantConfig, prefix: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_proj = Linear(c.hidden_size, [self.q_size, self.kv_size, self.kv_size], quant,
                               bias=c.attention_bias, shard_names=["q", "k", "v"], prefix=prefix + ".qkv_proj")
        self.o_proj = Linear(self.q_size, c.hidden_size, quant, prefix=prefix + ".o_proj")
        self.attn = Attention(c.num_heads, c.head_dim, 1.0 / math.sqrt(c.head_dim), c.num_kv_heads)
        # The key bias's outlier pairs for an int8 cache (attention/base.py's KeyBias), derived from
        # the loaded bias on first use (private: a model restored from the weight cache derives it too).
        self._key_bias: Optional[KeyBias | bool] = None

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, half: int, cache: Tensor,
                meta: AttentionMetadata, rotary: RotaryEmbedding) -> Tensor:
        """`cos`/`sin`: the step's rows of `rotary`'s tables, whose frequencies a quantized cache
        needs for the key bias's share of each cached key."""
        t = h.shape[0]
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(h)
        qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(t, nq + nkv, d), cos, sin, half)
        v = qkv[:, self.q_size + self.kv_size:].view(t, nkv, d)
        key_bias = None
        if meta.backend.quantized and self.qkv_proj.bias is not None:  # qwen2
            if self._key_bias is None:  # built on first use; False when no pair stands out
                k_bias = self.qkv_proj.bias[self.q_size:self.q_size + self.kv_size]
                self._key_bias = KeyBias.for_layer(k_bias, nkv, d, rotary.inv_freq, rotary.exact_cos_sin,
                                                   rotary.attention_scaling) or False
            key_bias = self._key_bias or None
        return self.o_proj(self.attn(qk[:, :nq], qk[:, nq:], v, cache, meta, key_bias))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, quant: QuantConfig, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, quant.dtype, prefix=prefix + ".input_layernorm")
        self.self_attn = LlamaAttention(c, quant, prefix + ".self_attn")
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, quant.dtype,
                                                prefix=prefix + ".post_attention_layernorm")
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, quant, "silu", prefix + ".mlp")


class LlamaModel(nn.Module):
    def __init__(self, c: ModelConfig, quant: QuantConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size, quant, prefix="model.embed_tokens")
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, quant, f"model.layers.{i}") for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, quant.dtype, prefix="model.norm")


class LlamaForCausalLM(nn.Module, ModelBase):
    """Decoder for `llama` and `qwen2` checkpoints (qwen2 adds a QKV bias). Besides its modules'
    forward it offers decode steps as one C call (models/fused_decode.py), which the runner takes
    where the plan applies."""

    def __init__(self, config: ModelConfig, quant: QuantConfig):
        super().__init__()
        self.config = config
        self.dtype = quant.dtype
        self.model = LlamaModel(config, quant)
        self.lm_head = (self.model.embed_tokens if config.tie_word_embeddings
                        else VocabEmbedding(config.vocab_size, config.hidden_size, quant, prefix="lm_head"))
        # Rebuilt in load_weights when the GGUF carries rope_freqs; built here so that a model restored
        # from the packed-weight cache (models/weight_cache.py) has the same modules.
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                          config.max_position_embeddings, self.dtype, None)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Union[Tensor, AnyWeight]]],
                     source: str = "checkpoint") -> None:
        extra: dict = {}
        load_named_weights(self, weights, source, extra)
        c = self.config
        freqs = extra.get("rope_freqs")
        if freqs is not None:
            self.rotary_emb = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings,
                                              self.dtype, as_float_tensor(freqs))

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor],
                attn_meta: AttentionMetadata, layers: Optional[Sequence[int]] = None) -> Tensor:
        """Final hidden states of the packed batch through the modules; `layers` runs only those
        decoder layers (self-speculative drafting), each still with its own cache."""
        cos, sin = self.rotary_emb(positions)
        half = self.rotary_emb.half
        x = self.model.embed_tokens.embed(input_ids)
        residual = None
        for i in (range(len(self.model.layers)) if layers is None else layers):
            layer, cache = self.model.layers[i], kv_caches[i]
            if residual is None:
                residual = x
                h = layer.input_layernorm(x)
            else:
                h, residual = layer.input_layernorm(x, residual)
            x = layer.self_attn(h, cos, sin, half, cache, attn_meta.for_layer(i), self.rotary_emb)
            h, residual = layer.post_attention_layernorm(x, residual)
            x = layer.mlp(h)
        return self.model.norm(x, residual)[0]

    def execution_paths(self) -> frozenset[ExecutionPath]:
        return frozenset({ExecutionPath.MODULES, ExecutionPath.C_DECODE})

    def plan_fused_decode(self) -> Optional[FusedDecode]:
        """The C decode step over these weights (see ModelBase), or None where some part has no
        C kernel here."""
        layers = [DecoderLayerParts(layer.input_layernorm, layer.self_attn.qkv_proj, layer.self_attn.attn,
                                    layer.self_attn.o_proj, layer.post_attention_layernorm, layer.mlp)
                  for layer in self.model.layers]
        return FusedDecode.build(DecoderParts(self.config, self.dtype, self.model.embed_tokens, self.rotary_emb,
                                              layers, self.model.norm))

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()
