"""Attention backends: each owns its KV cache layout, its step metadata and its kernel."""
from __future__ import annotations

from typing import Literal

from tessera.attention.base import AttentionBackend, AttentionMetadata, build_metadata
from tessera.attention.reference import ReferenceBackend
from tessera.attention.sdpa import SdpaBackend

AttentionBackendName = Literal["sdpa", "reference"]
BACKENDS: dict[str, type[AttentionBackend]] = {"sdpa": SdpaBackend, "reference": ReferenceBackend}


def get_backend(name: str) -> AttentionBackend:
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}") from None


__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionBackendName", "BACKENDS", "build_metadata",
           "get_backend"]
