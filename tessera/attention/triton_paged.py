"""The GPU's attention backend: the paged KV cache read in place by one Triton kernel per layer
(tessera/kernels/triton_attention.py) for decodes and prompt chunks alike.

The cache keeps the common layout (`[2, Hkv, blocks, block_size, D]`, see attention/base.py),
on the backend's device; step metadata is built on the host (O(batch) lists) and copied to the
device once per step, shared by every layer. bfloat16 and float32 caches only: the int8 format's
kernels are C for the CPU.

On a CPU the kernel runs under Triton's interpreter (tests at small shapes): correct, and far
too slow to serve with, so `auto` never picks this backend there.
"""
from __future__ import annotations

from typing import Optional

import torch

from tessera.attention.base import AttentionBackend, AttentionMetadata, build_metadata, check_sinks, write_kv
from tessera.kernels import triton_attention


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, kv_cache_dtype: str = "auto", device: "str | torch.device" = "cuda") -> None:
        why = triton_attention.available()
        if why is not None:
            raise ValueError(f"attention backend triton: {why}")
        if kv_cache_dtype == "int8":
            raise ValueError("--kv-cache-dtype int8 runs on the CPU kernels only; use auto or bfloat16 with the "
                             "triton attention backend")
        super().__init__(kv_cache_dtype)
        self.device = torch.device(device)
        if self.device.type == "cpu" and not triton_attention.interpreted():
            raise ValueError("the triton attention backend runs on a GPU (--device cuda); on a CPU only in "
                             "Triton's interpreter (TRITON_INTERPRET=1, for tests)")

    def build_metadata(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                       block_size: int) -> AttentionMetadata:
        meta = build_metadata(self, query_lens, seq_lens, block_tables, block_size)
        if self.device.type != "cpu":
            meta.slot_mapping = meta.slot_mapping.to(self.device, non_blocking=True)
            meta.block_tables = meta.block_tables.to(self.device, non_blocking=True)
        return meta

    def _step(self, meta: AttentionMetadata, group: int) -> tuple:
        """The step's tile map and lengths on the device (built once, shared by the layers)."""
        key = ("triton_tiles", group)
        cached = meta._cache.get(key)
        if cached is None:
            block_q, block_rows = triton_attention.rows_per_tile(group, meta.num_decodes == meta.num_reqs)
            req, first = triton_attention.tiles(meta.query_start_loc, block_q)
            host = torch.tensor([req, first], dtype=torch.int32)
            lens = torch.tensor([meta.query_start_loc, meta.seq_lens + [0]], dtype=torch.int32)
            host, lens = host.to(self.device, non_blocking=True), lens.to(self.device, non_blocking=True)
            cached = meta._cache[key] = (host[0], host[1], lens[0], lens[1, :-1], block_q, block_rows)
        return cached

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window: Optional[int], key_bias=None, softcap=None,
                sinks=None):
        if softcap is not None:
            raise NotImplementedError("the Triton attention kernel has no score soft-capping (Gemma 2)")
        sinks = check_sinks(sinks, q.shape[1], softcap, q.device)
        write_kv(kv_cache, k, v, meta)
        hq, d = q.shape[1], q.shape[2]
        tile_req, tile_start, query_start, seq_lens, block_q, block_rows = self._step(meta, hq // kv_cache.shape[1])
        out = torch.empty_like(q)
        triton_attention.paged_attention(q, kv_cache, out, meta.block_tables, tile_req, tile_start, query_start,
                                         seq_lens, scale, sliding_window, block_q, block_rows, sinks)
        return out.view(q.shape[0], hq * d)
