"""Attention backends: each owns its KV cache layout, its step metadata and its kernel."""
from __future__ import annotations

import logging

import torch

from tessera.attention.base import KV_CACHE_DTYPES, AttentionBackend, AttentionMetadata, build_metadata
from tessera.attention.paged import PagedBackend
from tessera.attention.reference import ReferenceBackend
from tessera.attention.sdpa import SdpaBackend
from tessera.attention.triton_paged import TritonBackend
from tessera.kernels.library import KernelUnavailable

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[AttentionBackend]] = {"paged": PagedBackend, "sdpa": SdpaBackend,
                                               "reference": ReferenceBackend, "triton": TritonBackend}


def get_backend(name: str, kv_cache_dtype: str = "auto", device: "str | torch.device" = "cpu") -> AttentionBackend:
    """The named backend with its cache format, for the device the model runs on.

    On a CPU "auto" is `paged` where its C kernel builds, else `sdpa`; on a GPU it is `triton`,
    the only backend whose cache and metadata live on the device. `triton` on a CPU runs its
    kernel under Triton's interpreter (tests only: far too slow to serve)."""
    device = torch.device(device)
    if device.type != "cpu":
        if name not in ("auto", "triton"):
            raise ValueError(f"attention backend {name!r} runs on the CPU; on {device.type} use triton (or auto)")
        return TritonBackend(kv_cache_dtype, device)
    if name == "triton":
        return TritonBackend(kv_cache_dtype, device)
    if name == "auto":
        try:
            return PagedBackend(kv_cache_dtype)
        except KernelUnavailable as exc:
            logger.warning("attention backend auto: the paged C kernel is unavailable (%s); using sdpa", exc)
            return SdpaBackend(kv_cache_dtype)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    return BACKENDS[name](kv_cache_dtype)


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "KV_CACHE_DTYPES", "build_metadata",
           "get_backend"]
