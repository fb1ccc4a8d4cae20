"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with mixture-of-experts feed-forward
blocks: softmax routing over all experts, the top k, renormalised when norm_topk_prob says (every
released checkpoint; llama.cpp always renormalises); dense MLPs in mlp_only_layers and off the
decoder_sparse_step."""
from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig, MoEConfig
from tessera.models.families.base import (Block, Family, GGUFMetadata, gguf_experts, hf_experts, need, need_gguf,
                                          refuse_sliding)


def _from_hf(hf: dict[str, Any], cfg: ModelConfig) -> None:
    refuse_sliding(hf, "qwen3_moe")
    cfg.attention_bias = bool(hf.get("attention_bias", False))
    experts, top_k = hf_experts(hf, "qwen3_moe")
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    sparse = [i not in dense and (i + 1) % step == 0 for i in range(cfg.num_layers)]
    cfg.moe = MoEConfig(num_experts=experts, top_k=top_k,
                        expert_ffn=int(need(hf, "moe_intermediate_size", "qwen3_moe")),
                        renormalize=bool(hf.get("norm_topk_prob", False)),
                        sparse_layers=None if all(sparse) else sparse)


def _from_gguf(gf: GGUFMetadata, cfg: ModelConfig) -> None:
    experts, top_k, sparse = gguf_experts(gf, "qwen3moe")
    cfg.moe = MoEConfig(num_experts=experts, top_k=top_k,
                        expert_ffn=int(need_gguf(gf, "expert_feed_forward_length", "qwen3moe")),
                        renormalize=True, sparse_layers=sparse)


FAMILY = Family(name="qwen3moe", hf_model_types=("qwen3_moe",), block=Block(qk_norm="head"),
                from_hf=_from_hf, from_gguf=_from_gguf, moe=True,
                summary="qwen3 + mixture of experts (softmax top-k, renormalised per norm_topk_prob)")
