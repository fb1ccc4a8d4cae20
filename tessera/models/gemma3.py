"""Gemma 3 text decoder built from tessera.layers.

Differs from llama in: embeddings scaled by sqrt(hidden), RMSNorm scale stored
as (1 + w) (folded in at load time), RMSNorm on each query/key head, norms
before *and* after attention and MLP, GELU-tanh MLP, and sliding-window layers
with their own RoPE base interleaved with global layers. The same speed
choices as tessera.models.llama apply (fused QKV and gate/up, table RoPE).
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.attention.base import AttentionMetadata
from tessera.config import ModelConfig
from tessera.errors import ModelFormatError
from tessera.layers import Attention, GatedMLP, Linear, QuantConfig, RMSNorm, RotaryEmbedding, VocabEmbedding, apply_rope
from tessera.layers.weights import AnyWeight
from tessera.models.base import ExecutionPath, ModelBase
from tessera.models.weights import load_named_weights


class Gemma3Attention(nn.Module):
    def __init__(self, c: ModelConfig, quant: QuantConfig, prefix: str, sliding: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.eps = c.rms_norm_eps
        self.qkv_proj = Linear(c.hidden_size, [self.q_size, self.kv_size, self.kv_size], quant,
                               shard_names=["q", "k", "v"], prefix=prefix + ".qkv_proj")
        self.o_proj = Linear(self.q_size, c.hidden_size, quant, prefix=prefix + ".o_proj")
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, quant.dtype, offset=1.0, prefix=prefix + ".q_norm")
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, quant.dtype, offset=1.0, prefix=prefix + ".k_norm")
        scale = float(c.query_pre_attn_scalar or c.head_dim) ** -0.5
        self.attn = Attention(c.num_heads, c.head_dim, scale, c.num_kv_heads, c.sliding_window if sliding else None)
        self.qk_scale: Optional[Tensor] = None  # [Hq + Hkv, D]: q_norm rows then k_norm rows

    def finish_loading(self) -> None:
        self.qk_scale = torch.cat([self.q_norm.weight.expand(self.num_heads, -1),
                                   self.k_norm.weight.expand(self.num_kv_heads, -1)]).contiguous()

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, cache: Tensor, meta: AttentionMetadata) -> Tensor:
        t = h.shape[0]
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(h)
        qk_end = self.q_size + self.kv_size
        # Per-head norm of Q and K heads in one call, each head with its own (1 + w) row.
        qk = F.rms_norm(qkv[:, :qk_end].view(t, nq + nkv, d), (d,), None, self.eps) * self.qk_scale
        qk = apply_rope(qk, cos, sin, d // 2)
        v = qkv[:, qk_end:].view(t, nkv, d)
        return self.o_proj(self.attn(qk[:, :nq], qk[:, nq:], v, cache, meta))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, quant: QuantConfig, prefix: str, sliding: bool):
        super().__init__()
        self.sliding = sliding

        def norm(name: str) -> RMSNorm:
            return RMSNorm(c.hidden_size, c.rms_norm_eps, quant.dtype, offset=1.0, prefix=f"{prefix}.{name}")

        self.input_layernorm = norm("input_layernorm")
        self.self_attn = Gemma3Attention(c, quant, prefix + ".self_attn", sliding)
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, quant, "gelu_tanh", prefix + ".mlp")
        self.post_feedforward_layernorm = norm("post_feedforward_layernorm")


class Gemma3Model(nn.Module):
    def __init__(self, c: ModelConfig, quant: QuantConfig, is_sliding: list[bool]):
        super().__init__()
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size, quant, prefix="model.embed_tokens")
        self.layers = nn.ModuleList(Gemma3DecoderLayer(c, quant, f"model.layers.{i}", is_sliding[i])
                                    for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, quant.dtype, offset=1.0, prefix="model.norm")


class Gemma3ForCausalLM(nn.Module, ModelBase):
    def __init__(self, config: ModelConfig, quant: QuantConfig):
        super().__init__()
        c = config
        if c.attn_logit_softcapping:
            raise ModelFormatError("Gemma models with attention logit soft-capping are not supported")
        self.config = c
        self.dtype = quant.dtype
        self.is_sliding = [w is not None for w in c.layer_windows()]
        # HF rounds the embedding scale to the compute dtype; do the same.
        self.embed_scale = torch.tensor(c.hidden_size ** 0.5, dtype=quant.dtype)
        self.model = Gemma3Model(c, quant, self.is_sliding)
        self.lm_head = (self.model.embed_tokens if c.tie_word_embeddings
                        else VocabEmbedding(c.vocab_size, c.hidden_size, quant, prefix="lm_head"))
        self.rotary_global = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings,
                                             self.dtype)
        self.rotary_local = RotaryEmbedding(c.head_dim, c.rope_local_base_freq or c.rope_theta, None,
                                            c.max_position_embeddings, self.dtype)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Union[Tensor, AnyWeight]]],
                     source: str = "checkpoint") -> None:
        load_named_weights(self, weights, source)
        for layer in self.model.layers:
            layer.self_attn.finish_loading()

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor],
                attn_meta: AttentionMetadata, layers: Optional[Sequence[int]] = None) -> Tensor:
        """Final hidden states of the packed batch; `layers` runs only those decoder layers
        (self-speculative drafting), each still with its own cache."""
        tables = {False: self.rotary_global(positions), True: self.rotary_local(positions)}
        x = self.model.embed_tokens.embed(input_ids) * self.embed_scale
        for i in (range(len(self.model.layers)) if layers is None else layers):
            layer, cache = self.model.layers[i], kv_caches[i]
            cos, sin = tables[layer.sliding]
            a = layer.self_attn(layer.input_layernorm(x), cos, sin, cache, attn_meta.for_layer(i))
            x = x + layer.post_attention_layernorm(a)
            h = layer.mlp(layer.pre_feedforward_layernorm(x))
            x = x + layer.post_feedforward_layernorm(h)
        return self.model.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def execution_paths(self) -> frozenset[ExecutionPath]:
        """The modules only: the C decode step is llama-shaped (one norm per sublayer, no
        sliding-window layers, no embedding scale)."""
        return frozenset({ExecutionPath.MODULES})
