"""Qwen3: llama's block with an RMSNorm on each query and key head, before RoPE."""
from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.models.families.base import Block, Family, refuse_sliding


def _from_hf(hf: dict[str, Any], cfg: ModelConfig) -> None:
    refuse_sliding(hf, "qwen3")
    cfg.attention_bias = bool(hf.get("attention_bias", False))


FAMILY = Family(name="qwen3", hf_model_types=("qwen3",), block=Block(qk_norm="head"), from_hf=_from_hf,
                summary="llama + per-head q/k RMSNorm")
