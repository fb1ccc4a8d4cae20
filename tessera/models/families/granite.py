"""Granite (3.x dense): llama's block with four multipliers: embeddings, attention scores (in place
of 1/sqrt(head_dim)), each sublayer's output before the residual add, and logits (divided)."""
from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.models.families.base import Family, GGUFMetadata, need, need_gguf, refuse_biases


def _from_hf(hf: dict[str, Any], cfg: ModelConfig) -> None:
    refuse_biases(hf, "granite")
    cfg.embedding_multiplier = float(need(hf, "embedding_multiplier", "granite"))
    cfg.attention_multiplier = float(need(hf, "attention_multiplier", "granite"))
    cfg.residual_multiplier = float(need(hf, "residual_multiplier", "granite"))
    cfg.logits_scaling = float(need(hf, "logits_scaling", "granite"))


def _from_gguf(gf: GGUFMetadata, cfg: ModelConfig) -> None:
    # llama.cpp's reading: the logit scale is required, a missing other one is no scaling
    # (attention: 1/sqrt(head_dim)).
    cfg.embedding_multiplier = gf.arch_key("embedding_scale")
    cfg.attention_multiplier = gf.arch_key("attention.scale")
    cfg.residual_multiplier = float(gf.arch_key("residual_scale") or 1.0)
    cfg.logits_scaling = float(need_gguf(gf, "logit_scale", "granite"))


FAMILY = Family(
    name="granite", hf_model_types=("granite",), from_hf=_from_hf, from_gguf=_from_gguf, gguf_permuted_qk=True,
    summary="llama + embedding, attention, residual and logit multipliers",
)
