"""Qwen2 and Qwen2.5: llama's block with a bias on the Q, K and V projections."""
from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.models.families.base import Family, refuse_sliding


def _from_hf(hf: dict[str, Any], cfg: ModelConfig) -> None:
    refuse_sliding(hf, "qwen2")
    cfg.attention_bias = True


FAMILY = Family(name="qwen2", hf_model_types=("qwen2",), from_hf=_from_hf, summary="llama + Q/K/V bias")
