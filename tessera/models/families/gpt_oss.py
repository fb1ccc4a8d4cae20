"""gpt-oss: llama's pre-norm layer with biases on every attention projection, a learned sink
logit per head in each softmax, sliding-window (128) layers alternating with full ones (layer 0
slides), YaRN RoPE, and mixture-of-experts blocks: a biased router whose top-k logits are
softmaxed, experts with biases and the clamped SwiGLU (up.clamp(+-7) + 1) * g * sigmoid(1.702 g),
g = gate.clamp(max=7). Its experts ship as MXFP4 blocks; llama.cpp's GGUF keeps them so."""
from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig, MoEConfig
from tessera.models.families.base import (Family, GGUFMetadata, gguf_experts, hf_experts, hf_layer_types, need,
                                          need_gguf)

SLIDING_PATTERN = 2  # every 2nd layer is full, as llama.cpp's gpt-oss reader assumes
# llama.cpp's SWIGLU_OAI constants; the GGUF carries none.
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702


def _biases(cfg: ModelConfig) -> None:
    cfg.attention_bias = cfg.attention_output_bias = True
    cfg.attention_sinks = True


def _from_hf(hf: dict[str, Any], cfg: ModelConfig) -> None:
    _biases(cfg)
    cfg.sliding_window = int(need(hf, "sliding_window", "gpt_oss"))
    cfg.sliding_window_pattern = SLIDING_PATTERN
    hf_layer_types(hf, cfg)
    experts, top_k = hf_experts(hf, "gpt_oss")
    cfg.moe = MoEConfig(num_experts=experts, top_k=top_k, expert_ffn=cfg.intermediate_size, renormalize=True,
                        router_bias=True, expert_bias=True, activation="swiglu_clamped",
                        swiglu_limit=float(hf.get("swiglu_limit", SWIGLU_LIMIT)),
                        swiglu_alpha=float(hf.get("swiglu_alpha", SWIGLU_ALPHA)))


def _from_gguf(gf: GGUFMetadata, cfg: ModelConfig) -> None:
    _biases(cfg)
    cfg.sliding_window = int(need_gguf(gf, "attention.sliding_window", "gpt-oss"))
    cfg.sliding_window_pattern = SLIDING_PATTERN
    if cfg.rope_scaling is not None and cfg.rope_scaling.get("rope_type") == "yarn":
        # gpt-oss's YaRN ramp is not rounded to whole dimensions (config.json's truncate: false).
        cfg.rope_scaling["truncate"] = False
    experts, top_k, _ = gguf_experts(gf, "gpt-oss")
    ffn = int(need_gguf(gf, "expert_feed_forward_length", "gpt-oss"))
    cfg.intermediate_size = ffn
    cfg.moe = MoEConfig(num_experts=experts, top_k=top_k, expert_ffn=ffn, renormalize=True, router_bias=True,
                        expert_bias=True, activation="swiglu_clamped", swiglu_limit=SWIGLU_LIMIT,
                        swiglu_alpha=SWIGLU_ALPHA)


FAMILY = Family(name="gpt-oss", hf_model_types=("gpt_oss",), from_hf=_from_hf, from_gguf=_from_gguf, moe=True,
                summary="llama + attention biases and sinks, alternating sliding window, YaRN, mixture of "
                        "experts (biased router, clamped SwiGLU)")
