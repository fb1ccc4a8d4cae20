"""Mixtral: llama's attention (Mistral's sliding window where the config sets one) with
mixture-of-experts feed-forward blocks, top-2 of 8 renormalised. In GGUF, llama.cpp writes it as
general.architecture "llama" with expert counts: the llama family reads those (families/llama.py)."""
from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig, MoEConfig
from tessera.models.families.base import Family, hf_experts, refuse_biases


def _from_hf(hf: dict[str, Any], cfg: ModelConfig) -> None:
    refuse_biases(hf, "mixtral")
    window = hf.get("sliding_window")
    if window and int(window) < cfg.max_position_embeddings:
        cfg.sliding_window = int(window)
        cfg.sliding_layers = [True] * cfg.num_layers
    experts, top_k = hf_experts(hf, "mixtral")
    cfg.moe = MoEConfig(num_experts=experts, top_k=top_k, expert_ffn=cfg.intermediate_size, renormalize=True)


FAMILY = Family(name="mixtral", hf_model_types=("mixtral",), from_hf=_from_hf, gguf_permuted_qk=True, moe=True,
                summary="llama + mixture of experts (softmax top-k renormalised); its GGUF is 'llama'")
