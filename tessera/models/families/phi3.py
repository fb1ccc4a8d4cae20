"""Phi-3, Phi-3.5 and Phi-4-mini: llama's block with Q/K/V and gate/up stored fused, LongRoPE
(short factors up to the pretraining length, long ones past it) and partial rotary."""
from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.errors import ModelFormatError
from tessera.models.families.base import Family, GGUFMetadata, need, refuse_biases


def _window(cfg: ModelConfig, window: Any) -> None:
    """A window shorter than the context makes every layer a sliding one (Phi-3-mini-4k: 2,047)."""
    if window and int(window) < cfg.max_position_embeddings:
        cfg.sliding_window = int(window)
        cfg.sliding_layers = [True] * cfg.num_layers


def _check_longrope(cfg: ModelConfig) -> None:
    """One short and one long factor per rotated frequency: checked with the config, before any
    weight loads."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return
    pairs = (cfg.rotary_dim or cfg.head_dim) // 2
    for key in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(key), list) or len(scaling[key]) != pairs:
            raise ModelFormatError(f"LongRoPE needs {pairs} {key} values (one per rotated frequency), "
                                   f"the file has {len(scaling.get(key) or [])}")


def _from_hf(hf: dict[str, Any], cfg: ModelConfig) -> None:
    refuse_biases(hf, "phi3")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        cfg.rotary_dim = int(cfg.head_dim * float(factor))
    scaling = cfg.rope_scaling
    if scaling is not None and (scaling.get("rope_type") or scaling.get("type")) in ("longrope", "su"):
        scaling = {k: v for k, v in scaling.items() if k not in ("type", "partial_rotary_factor")}
        scaling["rope_type"] = "longrope"
        scaling.setdefault("original_max_position_embeddings",
                           need(hf, "original_max_position_embeddings", "phi3"))
        cfg.rope_scaling = scaling
    _check_longrope(cfg)
    _window(cfg, hf.get("sliding_window"))


def _from_gguf(gf: GGUFMetadata, cfg: ModelConfig) -> None:
    dims = gf.arch_key("rope.dimension_count")
    if dims and int(dims) < cfg.head_dim:
        cfg.rotary_dim = int(dims)
    if "rope_factors_long.weight" in gf.tensors:  # LongRoPE, as convert_hf_to_gguf writes it
        cfg.rope_scaling = {
            "rope_type": "longrope",
            "long_factor": [float(x) for x in gf.dequantize("rope_factors_long.weight")],
            "short_factor": [float(x) for x in gf.dequantize("rope_factors_short.weight")],
            "original_max_position_embeddings": int(gf.arch_key("rope.scaling.original_context_length",
                                                                cfg.max_position_embeddings)),
            "attention_factor": float(gf.arch_key("rope.scaling.attn_factor", 1.0)),
        }
    _check_longrope(cfg)
    _window(cfg, gf.arch_key("attention.sliding_window"))


FAMILY = Family(
    name="phi3", hf_model_types=("phi3",), from_hf=_from_hf, from_gguf=_from_gguf, fused_projections=True,
    summary="llama with fused qkv and gate_up, LongRoPE, partial rotary",
)
