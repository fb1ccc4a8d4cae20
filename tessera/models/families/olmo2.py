"""OLMo 2: norms after attention and the MLP (none before), and an RMSNorm over the whole query and
key projections before RoPE."""
from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.models.families.base import Block, Family, GGUFMetadata, hf_layer_types, refuse_biases


def _from_hf(hf: dict[str, Any], cfg: ModelConfig) -> None:
    refuse_biases(hf, "olmo2")
    hf_layer_types(hf, cfg)


def _from_gguf(gf: GGUFMetadata, cfg: ModelConfig) -> None:
    pattern = gf.arch_key("attention.sliding_window_pattern")
    if isinstance(pattern, list) and any(pattern):
        cfg.sliding_window = int(gf.arch_key("attention.sliding_window"))
        cfg.sliding_layers = [bool(p) for p in pattern]


FAMILY = Family(
    name="olmo2", hf_model_types=("olmo2",), block=Block(pre_norms=False, post_norms=True, qk_norm="proj"),
    from_hf=_from_hf, from_gguf=_from_gguf, summary="post-norms only, q/k RMSNorm over the whole projection",
)
