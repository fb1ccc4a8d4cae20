"""The attention backend interface: KV cache layout, per-step metadata, and the kernel.

The engine never assumes a KV layout: it asks the backend for the cache's
shape, dtype and bytes per token (to size the cache from a memory budget),
allocates through it, and builds each step's metadata through it. Models
reach the backend only through the metadata handed to their Attention layers,
so a new backend (a C++ kernel, a quantized cache, a GPU kernel) slots in
without touching models or the engine.

Every backend stores, per layer, one tensor whose first two dimensions are
`[2, num_kv_heads]` (keys, values; KV heads outermost) followed by
`[num_blocks, block_size, head_dim]`. A token's slot is
`block_id * block_size + offset`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    """Where each request's tokens sit in the packed batch and in the KV cache.

    Requests are ordered decodes first (query length 1), then prefills. Built
    once per step and shared by every layer; `_cache` holds index tensors that
    layers of the same step reuse (masks, padding maps).
    """

    backend: "AttentionBackend"
    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    query_start_loc: list[int]  # [B+1] offsets of each request in the packed batch
    seq_lens: list[int]  # [B] context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with 0
    block_size: int
    num_decodes: int  # leading requests with exactly one query token
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


def build_metadata(
    backend: "AttentionBackend",
    query_lens: list[int],
    seq_lens: list[int],
    block_table_rows: list[list[int]],
    block_size: int,
) -> AttentionMetadata:
    """Metadata from per-request lists (decodes must come first); O(batch) Python work."""
    num_decodes = 0
    for q in query_lens:
        if q != 1:
            break
        num_decodes += 1
    query_start_loc = [0]
    for q in query_lens:
        query_start_loc.append(query_start_loc[-1] + q)
    width = max((len(r) for r in block_table_rows), default=1) or 1
    table = torch.tensor([r + [0] * (width - len(r)) for r in block_table_rows], dtype=torch.long)
    if num_decodes == len(query_lens):
        # Decode-only step: each request's one new token sits at position seq_len - 1.
        pos = torch.tensor(seq_lens, dtype=torch.long) - 1
        slots = table.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1) * block_size + pos % block_size
    else:
        qlens = torch.tensor(query_lens, dtype=torch.long)
        req = torch.repeat_interleave(torch.arange(len(query_lens)), qlens)
        first_pos = torch.tensor(seq_lens, dtype=torch.long) - qlens
        starts = torch.tensor(query_start_loc[:-1], dtype=torch.long)
        pos = torch.arange(query_start_loc[-1]) - starts[req] + first_pos[req]
        slots = table[req, pos // block_size] * block_size + pos % block_size
    return AttentionMetadata(backend, slots, query_start_loc, list(seq_lens), table, block_size, num_decodes)


class AttentionBackend(ABC):
    """One attention implementation and the KV cache layout it reads."""

    name: str = ""

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """Element type of the cache (the model's dtype unless the backend quantizes)."""
        return model_dtype

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> int:
        """Cache bytes one token takes across all layers (keys and values, any scales)."""
        return 2 * num_layers * num_kv_heads * head_dim * self.kv_cache_dtype(model_dtype).itemsize

    def allocate(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 model_dtype: torch.dtype) -> list[torch.Tensor]:
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        return [torch.zeros(shape, dtype=self.kv_cache_dtype(model_dtype)) for _ in range(num_layers)]

    def copy_blocks(self, src: list[torch.Tensor], dst: list[torch.Tensor], src_ids: torch.Tensor,
                    dst_ids: torch.Tensor) -> None:
        """Copy whole blocks between two caches of this layout (swap out / in)."""
        for s, d in zip(src, dst):
            d[:, :, dst_ids] = s[:, :, src_ids]

    def build_metadata(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                       block_size: int) -> AttentionMetadata:
        return build_metadata(self, query_lens, seq_lens, block_tables, block_size)

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: Optional[int]) -> torch.Tensor:
        """Store k/v `[T, Hkv, D]` at their slots, attend q `[T, Hq, D]`; return `[T, Hq * D]`."""


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store this step's keys and values at their slots (layout `[2, Hkv, blocks, bs, D]`)."""
    _, h, nb, bs, d = kv_cache.shape
    flat = kv_cache.view(2, h * nb * bs, d)
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if h == 1:
        flat[0].index_copy_(0, meta.slot_mapping, k[:, 0])
        flat[1].index_copy_(0, meta.slot_mapping, v[:, 0])
        return
    # One index_copy per K and V over all heads: head i's slots are offset by i * nb * bs.
    key = ("kv_slots", h, nb * bs)
    idx = meta._cache.get(key)
    if idx is None:
        idx = (meta.slot_mapping.unsqueeze(0) + torch.arange(h).unsqueeze(1) * (nb * bs)).reshape(-1)
        meta._cache[key] = idx
    flat[0].index_copy_(0, idx, k.transpose(0, 1).reshape(-1, d))
    flat[1].index_copy_(0, idx, v.transpose(0, 1).reshape(-1, d))
