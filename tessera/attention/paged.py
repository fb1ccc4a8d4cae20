"""Decode attention straight from the paged KV cache with a C kernel; prefills as in `sdpa`.

The `sdpa` backend first copies every decoding request's blocks into a dense
tensor (one gather per layer, ~9 ms of a 32-request step at 260 tokens of
context) and then runs batched matmuls over the padded result. Here each
(request, KV head) pair reads its keys and values where they lie, in parallel
on torch's OpenMP threads (tessera/kernels/paged_attention.c): no gathered
copy, no padding, no mask.
"""
from __future__ import annotations

import torch

from tessera import kernels
from tessera.attention.base import write_kv
from tessera.attention.sdpa import SdpaBackend


class PagedBackend(SdpaBackend):
    name = "paged"

    def __init__(self) -> None:
        why = kernels.available()
        if why is not None:
            raise kernels.KernelUnavailable(why)

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window):
        if not kernels.supports(q.shape[1], kv_cache):
            return super().forward(q, k, v, kv_cache, meta, scale, sliding_window)
        write_kv(kv_cache, k, v, meta)
        nd = meta.num_decodes
        hq, d = q.shape[1], q.shape[2]
        out = torch.empty_like(q)
        if nd > 0:
            cached = meta._cache.get("paged_decode")
            if cached is None:  # per step, shared by all layers: lengths, tables, score scratch
                seq_lens = torch.tensor(meta.seq_lens[:nd], dtype=torch.long)
                max_len = max(meta.seq_lens[:nd])
                cached = (seq_lens, meta.block_tables[:nd].contiguous(), max_len,
                          torch.empty(nd * hq * max_len, dtype=torch.float32))
                meta._cache["paged_decode"] = cached
            seq_lens, tables, max_len, scratch = cached
            o = kernels.paged_decode_attention(q[:nd], kv_cache, tables, seq_lens, max_len, scale, sliding_window,
                                               scratch)
            if nd == meta.num_reqs:  # a decode-only step: no prefill rows to place beside it
                return o.to(q.dtype).view(nd, hq * d)
            out[:nd] = o
        if nd < meta.num_reqs:
            self._prefill(q, k, v, kv_cache, meta, scale, sliding_window, out)
        return out.view(q.shape[0], hq * d)
