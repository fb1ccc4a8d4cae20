"""SmolLM3: llama's block where some layers use no RoPE at all (NoPE; every 4th by default)."""
from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.models.families.base import Family, GGUFMetadata, refuse_biases, refuse_sliding

NOPE_INTERVAL = 4  # transformers' and llama.cpp's default: layer i has no RoPE when (i + 1) % 4 == 0


def _default_nope(num_layers: int, interval: int = NOPE_INTERVAL) -> list[int]:
    return [i for i in range(num_layers) if (i + 1) % interval == 0]


def _from_hf(hf: dict[str, Any], cfg: ModelConfig) -> None:
    refuse_biases(hf, "smollm3")
    refuse_sliding(hf, "smollm3")
    uses_rope = hf.get("no_rope_layers")  # per layer: 1 = RoPE, 0 = NoPE (the name says the opposite)
    if uses_rope is None:
        cfg.nope_layers = _default_nope(cfg.num_layers, int(hf.get("no_rope_layer_interval") or NOPE_INTERVAL))
    else:
        cfg.nope_layers = [i for i, use in enumerate(uses_rope) if not use]


def _from_gguf(gf: GGUFMetadata, cfg: ModelConfig) -> None:
    cfg.nope_layers = _default_nope(cfg.num_layers)  # llama.cpp's rule; its files do not list the layers


FAMILY = Family(
    name="smollm3", hf_model_types=("smollm3",), from_hf=_from_hf, from_gguf=_from_gguf, gguf_permuted_qk=True,
    summary="llama with no RoPE in every 4th layer (NoPE)",
)
