"""The Triton paged-attention kernel against the reference loop, run by Triton's interpreter on
CPU tensors (the same kernel source the GPU compiles): decodes, prompt chunks over cached
context, grouped-query heads (a power of two and not), head sizes that are not a power of two,
sliding windows, scattered blocks, float32 and bfloat16, attention sinks."""
from __future__ import annotations

import pytest
import torch

from tessera.attention import get_backend
from tessera.attention.reference import ReferenceBackend
from tessera.kernels import triton_attention

from test_attention_backends import _case
from test_attention_sinks import sink_reference

pytestmark = pytest.mark.skipif(triton_attention.available() is not None, reason="triton unavailable")


def _run(qlens, seqlens, hq, hkv, d, bs=16, dtype=torch.float32, window=None, seed=0):
    cache, tables, q, k, v = _case(dtype, hq, hkv, d, bs, tuple(seqlens), seed, tokens=sum(qlens))
    outs, caches = [], []
    for backend in (get_backend("triton", device="cpu"), ReferenceBackend()):
        c = cache.clone()
        meta = backend.build_metadata(qlens, seqlens, tables, bs)
        outs.append(backend.forward(q, k, v, c, meta, d ** -0.5, window).float())
        caches.append(c)
    torch.testing.assert_close(caches[0], caches[1], atol=0, rtol=0)  # the step's keys written alike
    return outs


@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2), (12, 2), (3, 1)])
def test_decode_rows_match_reference(hq, hkv):
    tri, ref = _run([1, 1, 1], [1, 17, 70], hq, hkv, 64)
    torch.testing.assert_close(tri, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 12])
def test_prefill_chunks_over_cached_context_match_reference(window):
    # decodes first, then a whole prompt, a chunk after 20 cached tokens and one of 70 after 33
    tri, ref = _run([1, 1, 9, 5, 70], [5, 40, 9, 25, 103], 6, 2, 64, window=window)
    torch.testing.assert_close(tri, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("bs", [2, 24, 32])
def test_head_size_not_a_power_of_two_and_other_block_sizes(bs):
    tri, ref = _run([1, 30], [50, 64], 4, 2, 48, bs=bs)
    torch.testing.assert_close(tri, ref, atol=2e-5, rtol=0)


def test_bfloat16_cache():
    tri, ref = _run([1, 1, 20], [33, 8, 40], 6, 2, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(tri, ref, atol=3e-2, rtol=0)


def test_tiles_cover_every_query_once():
    block_q, rows = triton_attention.rows_per_tile(6, decode_only=False)
    assert rows == 64 and block_q == 10
    assert triton_attention.rows_per_tile(6, decode_only=True) == (2, 16)
    assert triton_attention.rows_per_tile(32, decode_only=True) == (1, 32)
    req, first = triton_attention.tiles([0, 1, 21, 22], 10)
    assert req == [0, 1, 1, 2] and first == [0, 0, 10, 0]
    assert [triton_attention.keys_per_step(b) for b in (2, 16, 24, 64, 256)] == [16, 16, 32, 64, 128]


def test_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="int8"):
        get_backend("triton", "int8", device="cpu")


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("hq, hkv", [(6, 2), (4, 4)])
def test_sinks_match_transformers_formula(hq, hkv, window, dtype, atol):
    """Sinks start the kernel's online softmax (maximum at the sink, sum at one): decodes, a whole
    prompt and chunks over cached context, against transformers' gpt-oss formula in float32."""
    qlens, seqlens = [1, 1, 9, 5, 70], [5, 40, 9, 25, 103]
    cache, tables, q, k, v = _case(dtype, hq, hkv, 64, 16, tuple(seqlens), 0, tokens=sum(qlens))
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(1)) * 2 + 3
    backend = get_backend("triton", device="cpu")
    got = backend.forward(q, k, v, cache.clone(), backend.build_metadata(qlens, seqlens, tables, 16), 0.125, window,
                          sinks=sinks).float()
    torch.testing.assert_close(got, sink_reference(q, k, v, cache, tables, qlens, seqlens, 16, 0.125, window, sinks),
                               atol=atol, rtol=0)
    silent = backend.forward(q, k, v, cache.clone(), backend.build_metadata(qlens, seqlens, tables, 16), 0.125,
                             window, sinks=torch.full((hq,), float("-inf"))).float()
    plain = backend.forward(q, k, v, cache.clone(), backend.build_metadata(qlens, seqlens, tables, 16), 0.125,
                            window).float()
    torch.testing.assert_close(silent, plain, atol=1e-6, rtol=0)
