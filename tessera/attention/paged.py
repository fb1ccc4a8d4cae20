"""Attention straight from the paged KV cache with C kernels, decodes and prefills.

The `sdpa` backend first copies every decoding request's blocks into a dense
tensor (one gather per layer, ~9 ms of a 32-request step at 260 tokens of
context) and then runs batched matmuls over the padded result. Here each
(request, KV head) pair reads its keys and values where they lie, in parallel
on torch's OpenMP threads (tessera/kernels/paged_attention.c): no gathered
copy, no padding, no mask. Prefill rows of a bfloat16 cache go to
tessera/kernels/prefill_attention.c the same way, first chunks and later ones
alike (2.6-3.4x SDPA's causal kernel on SmolLM2-135M's and Qwen2.5's heads,
which also left a chunk with cached context a gathered, padded, masked call);
an int8 cache's prefills take `sdpa`'s path. Attention sinks (gpt-oss) are taken
by all three kernels (the softmax's maximum starts at the sink, its sum at one); soft-capped
scores (Gemma 2) by the decode kernel of a bfloat16 or float32 cache, prefills of them by `sdpa`.
"""
from __future__ import annotations

import torch

from tessera.kernels import attention_ops, capabilities, library
from tessera.attention.base import (check_sinks, is_quantized, key_rotation, rotation_is_hadamard, step_positions,
                                    transform_for_cache, write_kv)
from tessera.attention.sdpa import SdpaBackend


# Steps of at most this many tokens transform keys and queries for an int8 cache in the kernels.
KERNEL_TRANSFORM_ROWS = 64


class PagedBackend(SdpaBackend):
    name = "paged"

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        why = library.available()
        if why is not None:
            raise library.KernelUnavailable(why)
        super().__init__(kv_cache_dtype)
        self._prefill_c = True

    def decode_in_c(self, num_heads, kv_cache):
        return (kv_cache.dtype in (torch.bfloat16, torch.float32) and kv_cache.dim() == 5
                and attention_ops.supports(num_heads, kv_cache))

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window, key_bias=None, softcap=None, sinks=None):
        quantized = is_quantized(kv_cache)
        # Soft-capped scores (Gemma 2): the decode kernel of a bfloat16 or float32 cache caps them (so
        # the one-call decode step and this path attend alike); the int8 one does not.
        if not attention_ops.supports(q.shape[1], kv_cache) or (softcap is not None and quantized):
            return super().forward(q, k, v, kv_cache, meta, scale, sliding_window, key_bias, softcap, sinks)
        sinks = check_sinks(sinks, q.shape[1], softcap, q.device)
        key_bias = key_bias if quantized else None
        if quantized:
            # Decode-sized steps transform keys (and below, queries) inside the kernels, saving two
            # PyTorch ops per layer; prefill-sized ones in one matrix product.
            rot, hadamard = key_rotation(q.shape[-1]), rotation_is_hadamard(q.shape[-1])
            positions = step_positions(meta) if key_bias is not None else None
            # The key bias as the kernels take it, for the step's writes and reads.
            args = key_bias.kernel_args(positions, meta._cache) if key_bias is not None else None
            if k.shape[0] <= KERNEL_TRANSFORM_ROWS:
                attention_ops.kv_write_int8(kv_cache, k, v, meta.slot_mapping, meta.block_size, rot, args, hadamard)
            else:
                kt = transform_for_cache(k if key_bias is None else k.float() - key_bias.at(positions))
                attention_ops.kv_write_int8(kv_cache, kt, v, meta.slot_mapping, meta.block_size)
        else:
            write_kv(kv_cache, k, v, meta)
        nd = meta.num_decodes
        hq, d = q.shape[1], q.shape[2]
        out = torch.empty_like(q)
        if nd > 0:
            cached = meta._cache.get("paged_decode")
            if cached is None:  # per step, shared by all layers: lengths, tables, score scratch
                seq_lens = torch.tensor(meta.seq_lens[:nd], dtype=torch.long)
                max_len = max(meta.seq_lens[:nd])
                scratch = (attention_ops.decode_int8_scratch(nd, hq, max_len, meta.block_size) if quantized
                           else torch.empty(nd * hq * max_len, dtype=torch.float32))
                cached = (seq_lens, meta.block_tables[:nd].contiguous(), max_len, scratch)
                meta._cache["paged_decode"] = cached
            seq_lens, tables, max_len, scratch = cached
            if quantized:
                o = attention_ops.paged_decode_attention_int8(q[:nd], kv_cache, tables, seq_lens, max_len,
                                                        meta.block_size, scale, sliding_window, scratch, rot, args,
                                                        hadamard, sinks)
            else:
                o = attention_ops.paged_decode_attention(q[:nd], kv_cache, tables, seq_lens, max_len, scale,
                                                         sliding_window, scratch, sinks, softcap)
            if nd == meta.num_reqs:  # a decode-only step: no prefill rows to place beside it
                return o.to(q.dtype).view(nd, hq * d)
            out[:nd] = o
        if nd < meta.num_reqs:
            if not quantized and softcap is None and self._prefill_in_c(q, kv_cache):
                start = meta.query_start_loc[nd]
                key = ("paged_prefill", sliding_window)
                if key not in meta._cache:  # per step, shared by all layers
                    meta._cache[key] = attention_ops.PrefillPlan.build(
                        [s - start for s in meta.query_start_loc[nd:]], meta.seq_lens[nd:],
                        meta.block_tables[nd:], sliding_window)
                try:
                    attention_ops.paged_prefill_attention(q[start:], kv_cache, meta._cache[key], scale, out[start:], sinks)
                    return out.view(q.shape[0], hq * d)
                except library.KernelUnavailable:  # built without AVX512-BF16: SDPA from now on
                    self._prefill_c = False
            self._prefill(transform_for_cache(q) if quantized else q, k, v, kv_cache, meta, scale,
                          sliding_window, out, key_bias, softcap, sinks)
        return out.view(q.shape[0], hq * d)

    def _prefill_in_c(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether prefill rows go to the C kernel (prefill_attention.c): a bfloat16 cache and
        queries of a shape it takes, on a build whose AVX512-BF16 path runs (its plain C path is the
        variants' reference, slower than PyTorch's sdpa)."""
        return (self._prefill_c and q.dtype == torch.bfloat16 and capabilities.bf16_matmuls()
                and attention_ops.prefill_supported(q.shape[1], kv_cache))
