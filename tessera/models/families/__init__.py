"""The decoder families Tessera runs, each a short description over the shared blocks (base.py)."""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from tessera.errors import ModelFormatError
from tessera.models.families import (gemma2, gemma3, gpt_oss, granite, granitehybrid, lfm2, llama, mixtral, olmo2,
                                     phi3, qwen2, qwen3, qwen3moe, smollm3)
from tessera.models.families.base import Block, Family

FAMILIES: Mapping[str, Family] = MappingProxyType({
    f.name: f for f in (m.FAMILY for m in (llama, qwen2, qwen3, gemma2, gemma3, phi3, olmo2, granite, smollm3,
                                              qwen3moe, mixtral, gpt_oss, lfm2, granitehybrid))
})
_BY_HF_TYPE = {t: f for f in FAMILIES.values() for t in f.hf_model_types}
ENCODERS = ("bert",)  # run by tessera/models/bert.py, not the decoder


def family(architecture: str) -> Family:
    """The family of a GGUF architecture name or ModelConfig.architecture."""
    return _lookup(FAMILIES, architecture, "architecture", [*FAMILIES, *ENCODERS])


def family_for_hf(model_type: str) -> Family:
    """The family of a config.json model_type."""
    return _lookup(_BY_HF_TYPE, model_type, "model type", [*_BY_HF_TYPE, *ENCODERS])


def _lookup(table: Mapping[str, Family], key: str, what: str, names: list[str]) -> Family:
    found = table.get(key)
    if found is None:
        raise ModelFormatError(f"{what} {key or '(none)'!r} is not supported; Tessera runs {', '.join(names)}")
    return found


__all__ = ["Block", "ENCODERS", "FAMILIES", "Family", "family", "family_for_hf", "supported"]
