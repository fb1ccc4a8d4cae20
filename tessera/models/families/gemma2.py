"""Gemma 2: norms before and after attention and the MLP, (1 + w) norm scales, GeGLU, scaled
embeddings, soft-capped attention scores and logits, sliding-window layers alternating with
global ones (layer 0 slides)."""
from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.models.families.base import Block, Family, GGUFMetadata, hf_layer_types, need

# llama.cpp's defaults where a Gemma 2 GGUF does not say (src/models/gemma2.cpp).
GGUF_SLIDING_WINDOW = 4096
SLIDING_PATTERN = 2  # every 2nd layer is global


def _from_hf(hf: dict[str, Any], cfg: ModelConfig) -> None:
    cfg.sliding_window = int(need(hf, "sliding_window", "gemma2"))
    cfg.sliding_window_pattern = SLIDING_PATTERN
    hf_layer_types(hf, cfg)
    cfg.query_pre_attn_scalar = float(need(hf, "query_pre_attn_scalar", "gemma2"))
    cfg.attn_logit_softcapping = hf.get("attn_logit_softcapping")
    cfg.final_logit_softcapping = hf.get("final_logit_softcapping")


def _from_gguf(gf: GGUFMetadata, cfg: ModelConfig) -> None:
    cfg.sliding_window = int(gf.arch_key("attention.sliding_window", GGUF_SLIDING_WINDOW))
    cfg.sliding_window_pattern = SLIDING_PATTERN
    # llama.cpp scales scores by 1/sqrt(head_dim) except for the 27B (46 layers): 1/sqrt(hidden/heads).
    cfg.query_pre_attn_scalar = float(cfg.hidden_size // cfg.num_heads if cfg.num_layers == 46 else cfg.head_dim)
    cfg.attn_logit_softcapping = gf.arch_key("attn_logit_softcapping")
    cfg.final_logit_softcapping = gf.arch_key("final_logit_softcapping")


FAMILY = Family(
    name="gemma2", hf_model_types=("gemma2",),
    block=Block(norm_offset=1.0, post_norms=True, activation="gelu_tanh", embed_scale=True),
    from_hf=_from_hf, from_gguf=_from_gguf, tied_by_default=True,
    summary="pre and post norms, (1+w) scales, GeGLU, sqrt(hidden) embeddings, attention and final "
            "soft-caps, alternating sliding window",
)
