"""Llama (1, 2, 3 with its RoPE scaling) and Mistral: the shared block itself."""
from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig, MoEConfig
from tessera.models.families.base import Family, GGUFMetadata, gguf_experts, refuse_biases


def _from_hf(hf: dict[str, Any], cfg: ModelConfig) -> None:
    refuse_biases(hf, "llama")
    window = hf.get("sliding_window")  # Mistral 7B v0.1: every layer sees the last 4,096 tokens
    if hf.get("model_type") == "mistral" and window and int(window) < cfg.max_position_embeddings:
        cfg.sliding_window = int(window)
        cfg.sliding_layers = [True] * cfg.num_layers



def _from_gguf(gf: GGUFMetadata, cfg: ModelConfig) -> None:
    """Mixtral's GGUF is a llama file with experts (families/mixtral.py)."""
    if gf.arch_key("expert_count"):
        experts, top_k, sparse = gguf_experts(gf, "llama")
        cfg.moe = MoEConfig(num_experts=experts, top_k=top_k, expert_ffn=cfg.intermediate_size, renormalize=True,
                            sparse_layers=sparse)


FAMILY = Family(
    name="llama", hf_model_types=("llama", "mistral"), from_hf=_from_hf, from_gguf=_from_gguf,
    gguf_permuted_qk=True,
    summary="pre-norm RMSNorm, SwiGLU, RoPE (llama3, linear and yarn scaling)",
)
