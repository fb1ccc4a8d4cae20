"""Gemma 3 text decoder over Tessera's packed batch and paged KV cache.

Differs from llama in: embeddings scaled by sqrt(hidden), RMSNorm scale stored
as (1 + w) (folded in at load time), RMSNorm on each query/key head, norms
before *and* after attention and MLP, GELU-tanh MLP, and sliding-window layers
with their own RoPE base interleaved with global layers. The same speed
choices as tessera.models.llama apply (fused QKV and gate/up, table RoPE).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.config import ModelConfig
from tessera.engine.attention import AttentionMetadata, paged_attention
from tessera.errors import ModelFormatError
from tessera.models.llama import Rope, apply_rope, collect_layer_weights, fuse_rows, set_param


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        c = config
        if c.attn_logit_softcapping:
            raise ModelFormatError("Gemma models with attention logit soft-capping are not supported")
        self.config = c
        self.dtype = dtype
        self.hidden = c.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.eps = c.rms_norm_eps
        self.scale = float(c.query_pre_attn_scalar or c.head_dim) ** -0.5
        self.num_layers = c.num_layers
        pattern = c.sliding_window_pattern or 0
        # Layer i is global when (i + 1) is a multiple of the pattern; without a window all are global.
        self.is_sliding = [bool(c.sliding_window) and pattern > 0 and (i + 1) % pattern != 0
                           for i in range(c.num_layers)]
        # HF rounds the embedding scale to the compute dtype; do the same.
        self.embed_scale = torch.tensor(c.hidden_size ** 0.5, dtype=dtype)

        def param(*shape: int) -> nn.Parameter:  # placeholder; load_weights assigns the real tensor
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"), requires_grad=False)

        self.embed_tokens = param(c.vocab_size, c.hidden_size)
        self.lm_head = self.embed_tokens if c.tie_word_embeddings else param(c.vocab_size, c.hidden_size)
        self.norm = param(c.hidden_size)
        self.layers = nn.ModuleList()
        for _ in range(c.num_layers):
            layer = nn.Module()
            layer.input_norm = param(c.hidden_size)
            layer.qkv = param(self.q_size + 2 * self.kv_size, c.hidden_size)
            layer.qk_norm = param(c.num_heads + c.num_kv_heads, c.head_dim)  # per-head (1 + w) rows
            layer.o_proj = param(c.hidden_size, self.q_size)
            layer.post_attn_norm = param(c.hidden_size)
            layer.pre_ffn_norm = param(c.hidden_size)
            layer.gate_up = param(2 * c.intermediate_size, c.hidden_size)
            layer.down = param(c.hidden_size, c.intermediate_size)
            layer.post_ffn_norm = param(c.hidden_size)
            self.layers.append(layer)
        self.rope_global: Optional[Rope] = None
        self.rope_local: Optional[Rope] = None

    # -- loading -------------------------------------------------------------
    LAYER_PARTS = [
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
        "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
        "self_attn.k_norm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]], source: str = "checkpoint") -> None:
        """Fuse, fold (1 + w) into the norms and cast HF-named float tensors, layer by layer."""
        parts = self.LAYER_PARTS
        globals_ = collect_layer_weights(weights, self.num_layers, parts, self._set_layer,
                                         self.config.tie_word_embeddings, source)
        set_param(self, "embed_tokens", globals_.pop("model.embed_tokens.weight"), "model.embed_tokens.weight")
        if self.config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            set_param(self, "lm_head", globals_.pop("lm_head.weight"), "lm_head.weight")
        set_param(self, "norm", 1.0 + globals_.pop("model.norm.weight").float(), "model.norm.weight")
        c = self.config
        self.rope_global = Rope(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings, self.dtype)
        local_base = c.rope_local_base_freq or c.rope_theta
        self.rope_local = Rope(c.head_dim, local_base, None, c.max_position_embeddings, self.dtype)

    def _set_layer(self, idx: int, p: dict[str, Tensor]) -> None:
        layer, pre = self.layers[idx], f"model.layers.{idx}."
        set_param(layer, "qkv", fuse_rows(p, "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                     "self_attn.v_proj.weight", prefix=pre), pre + "self_attn.q/k/v_proj.weight")
        q_norm, k_norm = p["self_attn.q_norm.weight"].float(), p["self_attn.k_norm.weight"].float()
        if q_norm.shape != (self.head_dim,) or k_norm.shape != (self.head_dim,):
            raise ModelFormatError(f"{pre}self_attn.q_norm/k_norm do not match head_dim {self.head_dim}")
        qk_norm = 1.0 + torch.cat([q_norm.expand(self.num_heads, -1), k_norm.expand(self.num_kv_heads, -1)])
        set_param(layer, "qk_norm", qk_norm, pre + "self_attn.q_norm/k_norm.weight")
        set_param(layer, "gate_up", fuse_rows(p, "mlp.gate_proj.weight", "mlp.up_proj.weight", prefix=pre),
                  pre + "mlp.gate/up_proj.weight")
        set_param(layer, "o_proj", p["self_attn.o_proj.weight"], pre + "self_attn.o_proj.weight")
        set_param(layer, "down", p["mlp.down_proj.weight"], pre + "mlp.down_proj.weight")
        for attr, src in (("input_norm", "input_layernorm.weight"),
                          ("post_attn_norm", "post_attention_layernorm.weight"),
                          ("pre_ffn_norm", "pre_feedforward_layernorm.weight"),
                          ("post_ffn_norm", "post_feedforward_layernorm.weight")):
            set_param(layer, attr, 1.0 + p[src].float(), pre + src)

    # -- running -------------------------------------------------------------
    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor],
                attn_meta: AttentionMetadata) -> Tensor:
        h_size, eps = (self.hidden,), self.eps
        qk_end = self.q_size + self.kv_size
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        t = input_ids.shape[0]
        tables = {False: self.rope_global(positions), True: self.rope_local(positions)}
        half = d // 2
        window = self.config.sliding_window
        x = F.embedding(input_ids, self.embed_tokens) * self.embed_scale
        for layer, cache, sliding in zip(self.layers, kv_caches, self.is_sliding):
            cos, sin = tables[sliding]
            h = F.rms_norm(x, h_size, layer.input_norm, eps)
            qkv = F.linear(h, layer.qkv)
            qk = F.rms_norm(qkv[:, :qk_end].view(t, nq + nkv, d), (d,), None, eps) * layer.qk_norm
            qk = apply_rope(qk, cos, sin, half)
            v = qkv[:, qk_end:].view(t, nkv, d)
            a = paged_attention(qk[:, :nq], qk[:, nq:], v, cache, attn_meta, self.scale,
                                window if sliding else None)
            x = x + F.rms_norm(F.linear(a, layer.o_proj), h_size, layer.post_attn_norm, eps)
            h = F.rms_norm(x, h_size, layer.pre_ffn_norm, eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            h = F.linear(F.gelu(gate, approximate="tanh") * up, layer.down)
            x = x + F.rms_norm(h, h_size, layer.post_ffn_norm, eps)
        return F.rms_norm(x, h_size, self.norm, eps)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        logits = F.linear(hidden, self.lm_head).float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
