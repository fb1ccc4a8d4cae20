"""Paged attention in Triton: every query of a step (decodes, prompt chunks after cached blocks)
against the paged KV cache read in place, one kernel launch per layer.

One program takes one tile of a request's queries for one KV head: `BLOCK_Q` consecutive query
tokens times the KV head's `group` query heads (GQA), so a decode row of a grouped model still
fills the matrix unit's rows (Qwen2-1.5B: 6 query heads per KV head) and each key block is read
once for all the heads that share it. The program walks the request's keys 16-128 at a time, each
key finding its block through the block table (so any block size works), from the first key its
queries may see (the sliding window's start) to the last one the causal mask allows, with an
online softmax in float32 (FlashAttention's recurrence), so no context is gathered or
padded and prefill chunks with prefix-cache hits need no special case. Attention sinks (gpt-oss:
a logit per query head in the softmax's denominator, with no value) start that recurrence: the
running maximum at the sink, the sum at exp(sink - sink) = 1.

Under TRITON_INTERPRET=1 the same kernel runs on CPU tensors in Triton's interpreter, so CI (no
GPU) tests the very code the GPU compiles, at small shapes (tests/attention/test_triton_attention.py; the
tests' conftest sets the variable where torch sees no GPU). The interpreter is far too slow to
serve with.
"""
import functools
import os
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - a dependency on Linux (pyproject.toml)
    triton = None
    tl = None


def available() -> Optional[str]:
    """None when the kernels can run, else why not."""
    return None if triton is not None else "triton is not installed"


# No `from __future__ import annotations` here: the interpreter finds constexpr parameters by their
# annotation objects.
def _paged_attention(
    q_ptr, k_ptr, v_ptr, out_ptr, sinks_ptr,
    block_tables_ptr, tile_req_ptr, tile_start_ptr, query_start_ptr, seq_lens_ptr,
    scale, window, block_size,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_ch, stride_cb, stride_cs, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr, SINKS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    q0 = tl.load(tile_start_ptr + tile)  # first query of the tile, counted within the request
    begin = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - begin
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len  # tokens cached before this step's queries

    rows = tl.arange(0, BLOCK_ROWS)
    tok = q0 + rows // GROUP  # query token of each row (within the request)
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (begin + tok)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter's dot mistakes bfloat16 operands (numpy has no bfloat16)
        q = q.to(tl.float32)
    q_pos = ctx + tok  # absolute position of each row's query

    m_i = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_ROWS], tl.float32)
    if SINKS:
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], tl.float32)
    hi = tl.minimum(ctx + q0 + BLOCK_Q, seq_len)  # keys past the tile's last query are never seen
    lo = 0
    if SLIDING:
        lo = tl.maximum(ctx + q0 - window + 1, 0)
    keys = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        # BLOCK_N keys a step, each found through the block table (a block may be smaller than a
        # step: tiny test blocks, or blocks not a power of two).
        k_pos = start + keys
        k_ok = k_pos < hi
        block = tl.load(block_tables_ptr + req * stride_bt + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
        at = kv_head * stride_ch + block[:, None] * stride_cb + (k_pos % block_size)[:, None] * stride_cs + dims[None, :]
        k = tl.load(k_ptr + at, mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
        v = tl.load(v_ptr + at, mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        seen = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        if SLIDING:
            seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (begin + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@functools.lru_cache(maxsize=1)
def _kernel():
    """The kernel, compiled for the GPU on its first launch (or run by Triton's interpreter when
    TRITON_INTERPRET=1 was set before triton was imported: the knob is read as functions are
    decorated, triton.language's own helpers included)."""
    return triton.jit(_paged_attention)


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors) in this process."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older ones read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def rows_per_tile(group: int, decode_only: bool) -> tuple[int, int]:
    """(`BLOCK_Q`, `BLOCK_ROWS`): query tokens a tile takes, and its padded row count (a power of
    two, at least 16, the matrix unit's smallest). Decode steps have one query per request, so
    their tiles are one token's heads; prefills take 64 rows (a key block's scores for 64 queries
    stay in registers on a GPU)."""
    rows = max(16 if decode_only else 64, triton.next_power_of_2(group))
    return max(1, rows // group), rows


def keys_per_step(block_size: int) -> int:
    """Keys a program reads per step of its loop: a block's worth when blocks are a power of two
    of 16 or more (the matrix unit's smallest width), else 16 or 32 keys across blocks."""
    return max(16, min(triton.next_power_of_2(block_size), 128))


def tiles(query_start_loc: list[int], block_q: int) -> tuple[list[int], list[int]]:
    """Each tile's request and first query (within the request): O(batch + tiles) host work,
    done once per step and shared by every layer."""
    req, first = [], []
    for i in range(len(query_start_loc) - 1):
        n = query_start_loc[i + 1] - query_start_loc[i]
        for s in range(0, n, block_q):
            req.append(i)
            first.append(s)
    return req, first


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, block_tables: torch.Tensor,
                    tile_req: torch.Tensor, tile_start: torch.Tensor, query_start: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, sliding_window: Optional[int], block_q: int,
                    block_rows: int, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out[T, Hq, D] = causal attention of q[T, Hq, D] over each request's cached keys and values
    (kv_cache [2, Hkv, blocks, block_size, D], this step's already written). The index tensors are
    int32/int64 on q's device; `tile_req`/`tile_start` from `tiles`. `sinks`: [Hq] float32 on q's
    device, each head's sink logit (AttentionBackend.forward), or None."""
    hq, d = q.shape[1], q.shape[2]
    hkv, block_size = kv_cache.shape[1], kv_cache.shape[3]
    group = hq // hkv
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    kernel = _kernel()
    grid = (tile_req.shape[0], hkv)
    sinks_arg = q if sinks is None else sinks  # any pointer when SINKS is off: never read
    kernel[grid](
        q, k_cache, v_cache, out, sinks_arg, block_tables, tile_req, tile_start, query_start, seq_lens,
        float(scale), int(sliding_window or 0), block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_Q=block_q, BLOCK_ROWS=block_rows,
        BLOCK_N=keys_per_step(block_size), SLIDING=bool(sliding_window), SINKS=sinks is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreted() and q.dtype != torch.float32,
    )
    return out
