"""The default CPU attention backend: batched matmuls for decodes, SDPA for prefills.

- Decode rows (one query each) attend in one pair of batched matmuls over
  their gathered context, with the query heads that share a KV head stacked as
  rows: for a single query row this is >10x faster on CPU than SDPA's flash
  kernel in bfloat16.
- Prefill chunks go through one `scaled_dot_product_attention` call, padded
  to the longest chunk with a causal mask; prompts with no cached context take
  the plain causal path instead, one call each, with no gather at all.
- Attention sinks (gpt-oss) ride on the same calls: decode rows add the sink to
  their softmax's denominator, SDPA calls take the CPU flash kernel's
  log-sum-exp and scale their output by sigmoid(lse - sink).
No Python loop per token; loops run over KV heads, or fresh prompts.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tessera.attention.base import (AttentionBackend, AttentionMetadata, add_key_bias, check_sinks,
                                    dequantize_blocks, is_quantized, rotate_for_cache, write_kv)


def gather_context(kv_cache: torch.Tensor, block_tables: torch.Tensor, max_len: int, bs: int,
                   meta: Optional[AttentionMetadata] = None, dtype: Optional[torch.dtype] = None):
    """Copy each request's blocks into dense keys and values, each [Hkv, B, L, D] (L = blocks * bs).

    One index_select over all (K/V, head, block) triples; the index depends only on the
    step's block tables, so it is built once per step and reused by every layer. An int8
    cache is dequantized into `dtype` (required then); other caches keep their dtype.
    """
    nblk = (max_len + bs - 1) // bs
    b = block_tables.shape[0]
    h, nb = kv_cache.shape[1], kv_cache.shape[2]
    cache = kv_cache.view(2 * h * nb, -1)
    if kv_cache.element_size() == 2 and cache.shape[1] % 2 == 0:
        # Move 16-bit blocks as int32 words: index_select is several times faster that way.
        cache = cache.view(torch.int32)
    key = ("gather", block_tables.data_ptr(), b, nblk, h, nb)
    index = meta._cache.get(key) if meta is not None else None
    if index is None:
        flat = block_tables[:, :nblk].reshape(-1)
        index = ((torch.arange(2 * h) * nb).unsqueeze(1) + flat.unsqueeze(0)).reshape(-1)
        if meta is not None:
            meta._cache[key] = index
    rows = cache.index_select(0, index).view(kv_cache.dtype)
    if is_quantized(kv_cache):
        assert dtype is not None, "an int8 cache is read into a compute dtype"
        out = dequantize_blocks(rows.view(2, h, b, nblk, -1), bs, dtype).view(2, h, b, nblk * bs, -1)
    else:
        out = rows.view(2, h, b, nblk * bs, kv_cache.shape[-1])
    return out[0], out[1]


def _decode_mask(meta: AttentionMetadata, sliding_window: Optional[int], length: int) -> torch.Tensor:
    key = ("decode", sliding_window, length)
    if key not in meta._cache:
        nd = meta.num_decodes
        lens = torch.tensor(meta.seq_lens[:nd]).unsqueeze(1)
        kpos = torch.arange(length).unsqueeze(0)
        mask = kpos < lens
        if sliding_window is not None:
            mask &= kpos > (lens - 1) - sliding_window
        meta._cache[key] = mask
    return meta._cache[key]


def _prefill_layout(meta: AttentionMetadata, sliding_window: Optional[int], length: int):
    """Index tensors to pad the prefill tokens into [Bp, maxq] and a matching mask."""
    key = ("prefill", sliding_window, length)
    if key not in meta._cache:
        nd = meta.num_decodes
        starts = meta.query_start_loc[nd:]
        qlens = [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]
        maxq = max(qlens)
        bp = len(qlens)
        pad_index = torch.full((bp, maxq), meta.num_tokens, dtype=torch.long)  # points at a zero row
        qpos = torch.zeros((bp, maxq), dtype=torch.long)
        valid = torch.zeros((bp, maxq), dtype=torch.bool)
        for j, (s, ql) in enumerate(zip(starts[:-1], qlens)):
            ctx = meta.seq_lens[nd + j]
            pad_index[j, :ql] = torch.arange(s, s + ql)
            qpos[j, :ql] = torch.arange(ctx - ql, ctx)
            valid[j, :ql] = True
        kpos = torch.arange(length).view(1, 1, -1)
        mask = kpos <= qpos.unsqueeze(-1)
        if sliding_window is not None:
            mask &= kpos > qpos.unsqueeze(-1) - sliding_window
        mask[:, :, 0] |= ~valid  # padded rows attend to something, so softmax stays finite
        meta._cache[key] = (pad_index, valid.view(-1).nonzero().view(-1), mask.unsqueeze(1), maxq)
    return meta._cache[key]


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The softmax of each row of float32 `scores` with one more logit, its sink (`sinks`
    broadcast to `scores[..., :1]`), that is dropped afterwards (gpt-oss's attention sinks):
    exp(s - m) / (sum exp(s - m) + exp(sink - m)), m the larger of the row's maximum and its sink.
    In place in `scores`; no concatenated copy of them as transformers' eager code makes."""
    m = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)
    e = scores.sub_(m).exp_()
    return e.div_(e.sum(dim=-1, keepdim=True) + torch.exp(sinks - m))


def sdpa_with_sinks(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, sinks: torch.Tensor, scale: float,
                    mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
    """SDPA with attention sinks: q [B, Hq, Lq, D] against keys/values [B, Hkv, L, D] (either
    `is_causal` or an additive `mask` [B, 1, Lq, L] of q's dtype) with `sinks` broadcast to [B, Hq, Lq].

    A sink adds exp(sink) to a row's softmax denominator and nothing to its numerator, so the
    output is the unsunk one times sigmoid(lse - sink), lse the row's log-sum-exp of its scaled
    scores. PyTorch's CPU flash kernel (what scaled_dot_product_attention runs here) computes lse
    and returns it beside its output, so this is exact at SDPA's speed, without the [Lq, L] float32
    scores that `capped_attention` makes."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys.to(q.dtype), vals.to(q.dtype), is_causal=is_causal, attn_mask=mask, scale=scale)
    return (o.float() * torch.sigmoid(lse - sinks).unsqueeze(-1)).to(q.dtype)


def _additive_mask(meta: AttentionMetadata, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask from `_prefill_layout` as the additive one `sdpa_with_sinks` takes (0 where
    True, -inf elsewhere, in `dtype`), made once per step and shared by the layers."""
    key = ("additive", mask.data_ptr(), dtype)
    if key not in meta._cache:
        meta._cache[key] = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    return meta._cache[key]


def decode_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor,
                     scale: float, softcap: Optional[float] = None,
                     sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [Bd, Hq, D] against gathered keys/values [Hkv, Bd, L, D] with a [Bd, L] mask -> [Bd, Hq, D].
    `softcap`: scores become softcap * tanh(score / softcap) before the softmax (Gemma 2). `sinks`
    [Hq] float32: each head's sink joins its softmax (AttentionBackend.forward)."""
    nd, hq, d = q.shape
    hkv = keys.shape[0]
    qg = q.view(nd, hkv, hq // hkv, d).transpose(0, 1)  # [Hkv, Bd, G, D]
    scores = torch.matmul(qg, keys.to(q.dtype).transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(~mask.view(1, nd, 1, -1), float("-inf"))
    if sinks is not None:
        probs = sink_softmax(scores, sinks.view(hkv, 1, hq // hkv, 1)).to(q.dtype)
    else:
        probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, vals.to(q.dtype)).transpose(0, 1).reshape(nd, hq, d)


def capped_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor, scale: float,
                     softcap: float) -> torch.Tensor:
    """SDPA with soft-capped scores, which no fused kernel here takes: q [B, Hq, Lq, D] against
    keys/values [B, Hkv, L, D] under a [B, 1, Lq, L] mask, float32 scores and softmax (as
    transformers' eager Gemma 2 attention)."""
    group = q.shape[1] // keys.shape[1]
    keys, vals = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.to(q.dtype).transpose(-1, -2)).float() * scale
    scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(q.dtype), vals.to(q.dtype))


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window, key_bias=None, softcap=None, sinks=None):
        sinks = check_sinks(sinks, q.shape[1], softcap, q.device)
        key_bias = key_bias if is_quantized(kv_cache) else None
        q, k = rotate_for_cache(kv_cache, q, k, meta, key_bias)
        write_kv(kv_cache, k, v, meta)
        bs = meta.block_size
        nd = meta.num_decodes
        hq, d = q.shape[1], q.shape[2]
        out = torch.empty_like(q)
        if nd == 1 and sliding_window is None and softcap is None:
            # One decode row: its exact context needs no mask, and SDPA beats the two batched
            # matmuls there (measured 12 vs 55 us at 32 tokens of context, bfloat16).
            seq_len = meta.seq_lens[0]
            keys, vals = gather_context(kv_cache, meta.block_tables[:1], seq_len, bs, meta, q.dtype)
            keys = add_key_bias(keys, key_bias)
            hkv = keys.shape[0]
            qg = q[:1].view(hkv, 1, hq // hkv, d)
            if sinks is not None:
                o = sdpa_with_sinks(qg, keys[:, :, :seq_len], vals[:, :, :seq_len], sinks.view(hkv, 1, hq // hkv),
                                    scale)
            else:
                o = F.scaled_dot_product_attention(qg, keys[:, :, :seq_len], vals[:, :, :seq_len], scale=scale)
            out[:1] = o.reshape(1, hq, d)
        elif nd > 0:
            max_len = max(meta.seq_lens[:nd])
            keys, vals = gather_context(kv_cache, meta.block_tables[:nd], max_len, bs, meta, q.dtype)
            keys = add_key_bias(keys, key_bias)
            mask = _decode_mask(meta, sliding_window, keys.shape[2])
            out[:nd] = decode_attention(q[:nd], keys, vals, mask, scale, softcap, sinks)
        if nd < meta.num_reqs:
            self._prefill(q, k, v, kv_cache, meta, scale, sliding_window, out, key_bias, softcap, sinks)
        return out.view(q.shape[0], hq * d)

    @staticmethod
    def _prefill(q, k, v, kv_cache, meta, scale, sliding_window, out, key_bias=None, softcap=None, sinks=None):
        """The prefill rows of a step (q already transformed for an int8 cache, whose keys get
        their bias share back here; `sinks` as check_sinks returns them)."""
        bs, nd = meta.block_size, meta.num_decodes
        hq, d = q.shape[1], q.shape[2]
        start = meta.query_start_loc[nd]
        prefill_lens = meta.seq_lens[nd:]
        qsl = meta.query_start_loc
        fresh = all(meta.seq_lens[i] == qsl[i + 1] - qsl[i] for i in range(nd, meta.num_reqs))
        if fresh and sliding_window is None and softcap is None:
            # Prompts with no cached context: each one's own k/v are its whole context, so each
            # takes SDPA's causal path, which skips the blocks above the diagonal (one padded call
            # with a mask computes every block of the longest prompt for every prompt: a burst of 4
            # prompts of 150-300 tokens took 9.2 ms a layer that way, ~4.6 ms this way). A quantized
            # cache is read back instead, so that every query sees the keys and values every later
            # one will (chunking, prefix hits and recomputation then give the same result).
            for i in range(nd, meta.num_reqs):
                a, b = qsl[i], qsl[i + 1]
                if is_quantized(kv_cache):
                    keys, vals = gather_context(kv_cache, meta.block_tables[i:i + 1], b - a, bs, meta, q.dtype)
                    keys = add_key_bias(keys, key_bias)
                    k_all = keys[:, :, :b - a].transpose(0, 1)  # [1, Hkv, L, D]
                    v_all = vals[:, :, :b - a].transpose(0, 1)
                else:
                    k_all = k[a:b].transpose(0, 1).unsqueeze(0).to(q.dtype)
                    v_all = v[a:b].transpose(0, 1).unsqueeze(0).to(q.dtype)
                qa = q[a:b].transpose(0, 1).unsqueeze(0)
                if sinks is not None:
                    o = sdpa_with_sinks(qa, k_all, v_all, sinks.view(1, hq, 1), scale, is_causal=True)
                else:
                    o = F.scaled_dot_product_attention(qa, k_all, v_all, is_causal=True, scale=scale, enable_gqa=True)
                out[a:b] = o.squeeze(0).transpose(0, 1)
            return
        keys, vals = gather_context(kv_cache, meta.block_tables[nd:], max(prefill_lens), bs, meta, q.dtype)
        keys = add_key_bias(keys, key_bias)
        keys, vals = keys.transpose(0, 1), vals.transpose(0, 1)  # [Bp, Hkv, L, D]
        pad_index, valid, mask, maxq = _prefill_layout(meta, sliding_window, keys.shape[2])
        q_ext = torch.cat([q, q.new_zeros((1, hq, d))])
        qp = q_ext.index_select(0, pad_index.view(-1)).view(*pad_index.shape, hq, d).transpose(1, 2)
        if softcap is not None:
            o = capped_attention(qp, keys, vals, mask, scale, softcap)
        elif sinks is not None:
            o = sdpa_with_sinks(qp, keys, vals, sinks.view(1, hq, 1), scale, mask=_additive_mask(meta, mask, q.dtype))
        else:
            o = F.scaled_dot_product_attention(
                qp, keys.to(q.dtype), vals.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[start:] = o.transpose(1, 2).reshape(-1, hq, d).index_select(0, valid)
