"""Gemma 3 (text): Gemma 2's block with an RMSNorm on each query and key head (its configs turn
the soft-caps off); five sliding-window layers of six, with their own RoPE base."""
from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.models.families.base import Block, Family, GGUFMetadata

# Facts llama.cpp hard-codes instead of writing them into the file.
SLIDING_WINDOW_PATTERN = 6  # every 6th layer attends globally
ROPE_LOCAL_BASE = 10000.0


def _from_hf(hf: dict[str, Any], cfg: ModelConfig) -> None:
    cfg.sliding_window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types and "full_attention" in layer_types:
        cfg.sliding_window_pattern = layer_types.index("full_attention") + 1
    else:
        cfg.sliding_window_pattern = (hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
                                      or SLIDING_WINDOW_PATTERN)
    rope = hf.get("rope_parameters") or {}
    local = rope.get("sliding_attention", {}) if "full_attention" in rope else {}
    cfg.rope_local_base_freq = float(hf.get("rope_local_base_freq") or local.get("rope_theta") or ROPE_LOCAL_BASE)
    cfg.query_pre_attn_scalar = float(hf.get("query_pre_attn_scalar") or cfg.head_dim)
    cfg.final_logit_softcapping = hf.get("final_logit_softcapping")
    cfg.attn_logit_softcapping = hf.get("attn_logit_softcapping")


def _from_gguf(gf: GGUFMetadata, cfg: ModelConfig) -> None:
    cfg.sliding_window = gf.arch_key("attention.sliding_window")
    pattern = gf.arch_key("attention.sliding_window_pattern", SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # per-layer flags (True = sliding); find the period
        globals_ = [i for i, sliding in enumerate(pattern) if not sliding]
        pattern = globals_[0] + 1 if globals_ else len(pattern) + 1
    cfg.sliding_window_pattern = int(pattern)
    cfg.rope_local_base_freq = float(gf.arch_key("rope.freq_base_swa", ROPE_LOCAL_BASE))
    # llama.cpp scales scores by 1/sqrt(head_dim) for every Gemma 3 size but 27B, which it
    # recognises by its layer count and scales by 1/sqrt(hidden/heads) instead.
    cfg.query_pre_attn_scalar = float(cfg.hidden_size // cfg.num_heads if cfg.num_layers == 62 else cfg.head_dim)
    cfg.final_logit_softcapping = gf.arch_key("final_logit_softcapping")
    cfg.attn_logit_softcapping = gf.arch_key("attn_logit_softcapping")


FAMILY = Family(
    name="gemma3", hf_model_types=("gemma3_text", "gemma3"),
    block=Block(norm_offset=1.0, post_norms=True, qk_norm="head", activation="gelu_tanh", embed_scale=True),
    from_hf=_from_hf, from_gguf=_from_gguf, tied_by_default=True,
    summary="Gemma 2's block + per-head q/k norm, 5 of 6 layers sliding with their own RoPE base",
)
