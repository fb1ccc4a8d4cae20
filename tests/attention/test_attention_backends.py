"""Attention backends against the reference loop: the paged C kernel (bfloat16 and float32 caches,
grouped-query heads, sliding windows, ragged contexts over scattered blocks) and the sdpa backend."""
from __future__ import annotations

import pytest
import torch

from tessera.kernels import attention_ops, capabilities, library
from tessera.attention import BACKENDS, get_backend
from tessera.attention.reference import ReferenceBackend

pytestmark = pytest.mark.skipif(library.available() is not None, reason="C kernels unavailable here")


def _case(dtype, hq=6, hkv=2, d=64, bs=16, lens=(1, 17, 40, 300), seed=0, tokens=None):
    """A random cache over scattered blocks for contexts of `lens`, and q/k/v for `tokens` step
    tokens (default: one per context, a decode step)."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = sum((n + bs - 1) // bs for n in lens) + 3
    cache = torch.randn(2, hkv, nblocks, bs, d, generator=gen).to(dtype)
    order = torch.randperm(nblocks, generator=gen).tolist()  # blocks scattered on purpose
    tables, pos = [], 0
    for n in lens:
        k = (n + bs - 1) // bs
        tables.append(order[pos:pos + k])
        pos += k
    t = len(lens) if tokens is None else tokens
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    return cache, tables, q, k, v


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("name", ["paged", "sdpa"])
@pytest.mark.parametrize("d", [64, 32, 48, 128])  # the float32 AVX2 loops: 64-value chunks, 32, generic
def test_decode_matches_reference(name, dtype, atol, window, d):
    cache, tables, q, k, v = _case(dtype, d=d)
    lens = [1, 17, 40, 300]
    outs = []
    for backend in (get_backend(name), ReferenceBackend()):
        c = cache.clone()
        meta = backend.build_metadata([1] * len(lens), lens, tables, 16)
        outs.append(backend.forward(q, k, v, c, meta, 0.125, window).float())
    torch.testing.assert_close(outs[0], outs[1], atol=atol, rtol=0)


@pytest.mark.parametrize("lens", [[260], [5, 33]])
def test_paged_decode_with_prefill_rows_matches_reference(lens):
    cache, tables, q, k, v = _case(torch.float32, lens=tuple(lens) + (20,))
    qlens = [1] * len(lens) + [4]  # decodes first, then a 4-token chunk over cached context
    seq = list(lens) + [20]
    t = sum(qlens)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(t, h, 64, generator=gen) for h in (6, 2, 2))
    outs = []
    for backend in (get_backend("paged"), ReferenceBackend()):
        c = cache.clone()
        meta = backend.build_metadata(qlens, seq, tables, 16)
        outs.append(backend.forward(q, k, v, c, meta, 0.125, None))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("qlens, seq", [
    ([7, 30, 19], [7, 30, 19]),  # a burst of fresh prompts: one causal call each
    ([1, 1, 12, 25], [40, 9, 12, 25]),  # the same beside decodes
    ([1, 12, 4], [40, 12, 20]),  # a fresh prompt beside a chunk over cached context: the padded call
], ids=["fresh", "fresh-with-decodes", "fresh-and-continued"])
@pytest.mark.parametrize("name", ["paged", "sdpa"])
def test_prompts_in_one_step_match_reference(name, dtype, atol, qlens, seq):
    cache, tables, _, _, _ = _case(dtype, lens=tuple(seq))
    gen = torch.Generator().manual_seed(2)
    t = sum(qlens)
    q, k, v = (torch.randn(t, h, 64, generator=gen).to(dtype) for h in (6, 2, 2))
    outs = []
    for backend in (get_backend(name), ReferenceBackend()):
        c = cache.clone()
        meta = backend.build_metadata(qlens, seq, tables, 16)
        outs.append(backend.forward(q, k, v, c, meta, 0.125, None).float())
    torch.testing.assert_close(outs[0], outs[1], atol=atol, rtol=0)


def test_backend_registry_and_auto():
    assert set(BACKENDS) == {"paged", "sdpa", "reference", "triton"}
    assert get_backend("auto").name == "paged"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("flash")


def test_kernel_refuses_unsupported_shapes():
    cache = torch.zeros(2, 1, 4, 128, 64)  # block size 128 > 64
    with pytest.raises(library.KernelUnavailable, match="block size 128"):
        attention_ops.paged_decode_attention(torch.zeros(1, 2, 64), cache, torch.zeros(1, 1, dtype=torch.long),
                                       torch.ones(1, dtype=torch.long), 1, 1.0, None)


def test_paged_backend_falls_back_for_large_blocks():
    backend = get_backend("paged")
    cache = torch.randn(2, 1, 3, 128, 64)
    q, k, v = torch.randn(1, 2, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64)
    outs = []
    for b in (backend, ReferenceBackend()):
        meta = b.build_metadata([1], [200], [[2, 0]], 128)
        outs.append(b.forward(q, k, v, cache.clone(), meta, 0.125, None))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_kernel_reads_row_strided_queries(dtype, atol):
    """Models hand over Q as a view into the fused QKV output; the kernel reads it in place."""
    cache, tables, q, k, v = _case(dtype)
    lens = [1, 17, 40, 300]
    fused = torch.cat([q, k, v], dim=1)  # [B, Hq + 2 Hkv, D], like qkv_proj's output
    strided = fused[:, :6]
    assert not strided.is_contiguous()
    table = torch.tensor([t + [0] * (19 - len(t)) for t in tables])
    got = attention_ops.paged_decode_attention(strided, cache, table, torch.tensor(lens), max(lens), 0.125, None)
    want = attention_ops.paged_decode_attention(q.contiguous(), cache, table, torch.tensor(lens), max(lens), 0.125, None)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


needs_bf16_kernel = pytest.mark.skipif(library.available() is not None or not capabilities.bf16_matmuls(),
                                       reason="the prefill kernel needs AVX512-BF16")


@needs_bf16_kernel
@pytest.mark.parametrize("hq, hkv, d, bs", [(9, 3, 64, 16), (12, 2, 128, 16), (4, 1, 256, 32), (8, 8, 32, 16),
                                            (16, 1, 64, 64)])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("qlens, seq", [
    ([1, 1, 250, 37, 1], [30, 90, 250, 37, 1]),  # decodes, fresh prompts (tiles of 16, blocks of 64 keys)
    ([77, 3, 130], [177, 8, 130]),  # chunks over cached context beside a fresh prompt
    ([64], [64]), ([65], [129]),  # block edges
])
def test_prefill_kernel_matches_reference(hq, hkv, d, bs, window, qlens, seq):
    """The paged backend's prefill rows (prefill_attention.c: its key tiles and value pairs, the
    causal and window masks where a block of 64 keys crosses them, the online softmax, query tiles
    of 16 rows times the group's heads in groups of 4, 2 or 1) against the float32 loop."""
    cache, tables, _, _, _ = _case(torch.bfloat16, hq=hq, hkv=hkv, d=d, bs=bs, lens=tuple(seq))
    gen = torch.Generator().manual_seed(3)
    t = sum(qlens)
    fused = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(torch.bfloat16)  # as qkv_proj's output
    q, k, v = fused[:, :hq], fused[:, hq:hq + hkv], fused[:, hq + hkv:]
    outs = []
    for backend in (get_backend("paged"), ReferenceBackend()):
        c = cache.clone()
        meta = backend.build_metadata(qlens, seq, tables, bs)
        outs.append(backend.forward(q, k, v, c, meta, d ** -0.5, window).float())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=0)


@needs_bf16_kernel
def test_prefill_kernel_reads_nothing_before_the_window():
    """A sliding-window layer may have handed the blocks behind its window to other requests: the
    kernel's copies start at the window (zeros before it), so whatever those blocks hold (here NaN)
    never reaches a query."""
    bs, window, seq, qlen = 16, 24, 200, 5
    cache, tables, _, _, _ = _case(torch.bfloat16, lens=(seq,), bs=bs)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(qlen, h, 64, generator=gen).to(torch.bfloat16) for h in (6, 2, 2))
    stale = tables[0][:(seq - qlen - window + 1) // bs]  # wholly before the first query's window
    poisoned = cache.clone()
    poisoned[:, :, stale] = float("nan")
    backend = get_backend("paged")
    got = backend.forward(q, k, v, poisoned, backend.build_metadata([qlen], [seq], tables, bs), 0.125, window)
    ref = ReferenceBackend()
    want = ref.forward(q, k, v, cache.clone(), ref.build_metadata([qlen], [seq], tables, bs), 0.125, window)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)


@needs_bf16_kernel
def test_prefill_plan_must_cover_the_queries():
    cache, tables, _, _, _ = _case(torch.bfloat16, lens=(20,))
    table = torch.tensor([tables[0]])
    plan = attention_ops.PrefillPlan.build([0, 20], [20], table, None)
    with pytest.raises(ValueError, match="covers 20 rows"):
        attention_ops.paged_prefill_attention(torch.zeros(19, 6, 64, dtype=torch.bfloat16), cache, plan, 0.125)
    with pytest.raises(library.KernelUnavailable, match="head_dim 48"):
        attention_ops.paged_prefill_attention(torch.zeros(20, 6, 48, dtype=torch.bfloat16),
                                        torch.zeros(2, 2, 4, 16, 48, dtype=torch.bfloat16), plan, 0.125)


@needs_bf16_kernel
def test_paged_backend_prefills_through_sdpa_without_the_kernel(monkeypatch):
    """Where the prefill kernel cannot run (a build without AVX512-BF16 says so on its first call),
    the paged backend computes prefill rows on sdpa's path from then on, with the same result. Only
    where the host has AVX512-BF16: elsewhere the backend never asks the kernel (paged.py)."""
    calls = []

    def unavailable(*args, **kwargs):
        calls.append(1)
        raise library.KernelUnavailable("paged_prefill_attention needs AVX512-BF16 on the build machine")

    monkeypatch.setattr(attention_ops, "paged_prefill_attention", unavailable)
    qlens, seq = [1, 12, 4], [40, 12, 20]
    cache, tables, _, _, _ = _case(torch.bfloat16, lens=tuple(seq))
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(sum(qlens), h, 64, generator=gen).to(torch.bfloat16) for h in (6, 2, 2))
    backend, ref = get_backend("paged"), ReferenceBackend()
    for _ in range(2):
        got = backend.forward(q, k, v, cache.clone(), backend.build_metadata(qlens, seq, tables, 16), 0.125, None)
        want = ref.forward(q, k, v, cache.clone(), ref.build_metadata(qlens, seq, tables, 16), 0.125, None)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)
    assert calls == [1]  # asked once, then never again


@needs_bf16_kernel
@pytest.mark.parametrize("window", [None, 4096])
def test_prefill_kernel_takes_long_contexts(monkeypatch, window):
    """A chunk over 41k tokens of cached context on 4 KV heads of 128 (84 MB of keys and values)
    beside a fresh prompt stays on the kernel, which copies 64 keys at a time per thread rather
    than the context, and matches sdpa's path."""
    calls = []
    kernel = attention_ops.paged_prefill_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention_ops, "paged_prefill_attention", counted)
    qlens, seq = [24, 30], [41_000, 30]
    cache, tables, _, _, _ = _case(torch.bfloat16, hq=8, hkv=4, d=128, lens=tuple(seq))
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(sum(qlens), h, 128, generator=gen).to(torch.bfloat16) for h in (8, 4, 4))
    backend, sdpa = get_backend("paged"), get_backend("sdpa")
    got = backend.forward(q, k, v, cache.clone(), backend.build_metadata(qlens, seq, tables, 16), 128 ** -0.5,
                          window)
    want = sdpa.forward(q, k, v, cache.clone(), sdpa.build_metadata(qlens, seq, tables, 16), 128 ** -0.5, window)
    assert calls == [1] and backend._prefill_c
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)
