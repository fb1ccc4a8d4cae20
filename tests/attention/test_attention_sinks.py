"""Attention sinks (gpt-oss: a learned logit per query head that joins the softmax's denominator and
adds no value) in every CPU backend and kernel, against a plain float32 loop written from
transformers' eager gpt-oss attention: decodes, fresh prompts, chunks over cached context, sliding
windows, grouped-query heads, float32 / bfloat16 / int8 caches; sinks of -inf are no sinks."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.kernels import attention_ops, capabilities, library
from tessera.attention import get_backend
from tessera.attention.reference import ReferenceBackend
from tessera.layers.attention import Attention

from test_attention_backends import _case

pytestmark = pytest.mark.skipif(library.available() is not None, reason="C kernels unavailable here")


def sink_reference(q, k, v, cache, tables, qlens, seqs, bs, scale, window, sinks):
    """transformers' `eager_attention_forward` of gpt-oss, request by request in float32: scores plus
    the additive causal (and window) mask, the sinks as one more column, the row maximum taken
    off, softmax, the sink column dropped, times the values. The context is read from `cache` as it
    was before the step, its last rows replaced by the step's k/v (no backend code involved)."""
    hq, hkv, d = q.shape[1], cache.shape[1], cache.shape[-1]
    out = torch.empty(q.shape, dtype=torch.float32)
    start = 0
    for table, qlen, seq in zip(tables, qlens, seqs):
        kv = cache[:, :, table].reshape(2, hkv, -1, d)[:, :, :seq].float().clone()
        kv[0, :, seq - qlen:] = k[start:start + qlen].transpose(0, 1).float()
        kv[1, :, seq - qlen:] = v[start:start + qlen].transpose(0, 1).float()
        keys, vals = (x.repeat_interleave(hq // hkv, dim=0) for x in kv)  # [Hq, L, D]
        scores = torch.einsum("qhd,hkd->hqk", q[start:start + qlen].float(), keys) * scale
        qpos = torch.arange(seq - qlen, seq).unsqueeze(1)
        kpos = torch.arange(seq).unsqueeze(0)
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        scores = scores + torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        combined = torch.cat([scores, sinks.float().view(hq, 1, 1).expand(hq, qlen, 1)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]
        out[start:start + qlen] = torch.einsum("hqk,hkd->qhd", probs, vals)
        start += qlen
    return out.view(q.shape[0], hq * d)


STEPS = {
    "decodes": ([1, 1, 1, 1], [1, 17, 40, 300]),
    "one-decode": ([1], [33]),  # sdpa's single-row SDPA call
    "fresh": ([7, 30, 19], [7, 30, 19]),  # sdpa's causal call per prompt
    "mixed": ([1, 1, 12, 4, 25], [40, 9, 12, 20, 25]),  # decodes, fresh prompts, a chunk over cached context
}


def _step(dtype, hq, hkv, step, d=64, bs=16, seed=0):
    qlens, seqs = STEPS[step]
    cache, tables, q, k, v = _case(dtype, hq=hq, hkv=hkv, d=d, bs=bs, lens=tuple(seqs), seed=seed,
                                   tokens=sum(qlens))
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(seed + 7)) * 2 + 3  # on a par with lse
    return cache, tables, q, k, v, qlens, seqs, sinks


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("hq, hkv", [(6, 2), (4, 4)])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("name", ["reference", "sdpa", "paged"])
def test_sinks_match_transformers_formula(name, step, hq, hkv, window, dtype, atol):
    cache, tables, q, k, v, qlens, seqs, sinks = _step(dtype, hq, hkv, step)
    want = sink_reference(q, k, v, cache, tables, qlens, seqs, 16, 0.125, window, sinks)
    backend = get_backend(name)
    meta = backend.build_metadata(qlens, seqs, tables, 16)
    got = backend.forward(q, k, v, cache.clone(), meta, 0.125, window, sinks=sinks).float()
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    # The sinks matter at these values: the same step without them is far from the reference.
    plain = backend.forward(q, k, v, cache.clone(), backend.build_metadata(qlens, seqs, tables, 16), 0.125, window)
    assert (plain.float() - want).abs().max() > 5 * atol


@pytest.mark.parametrize("sink", [float("-inf"), -1e30])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("step", ["decodes", "one-decode", "fresh", "mixed"])
@pytest.mark.parametrize("name", ["reference", "sdpa", "paged"])
def test_sinks_of_minus_infinity_are_no_sinks(name, step, window, sink):
    cache, tables, q, k, v, qlens, seqs, _ = _step(torch.float32, 6, 2, step)
    backend = get_backend(name)
    outs = []
    for kwargs in ({}, {"sinks": torch.full((6,), sink)}):
        meta = backend.build_metadata(qlens, seqs, tables, 16)
        outs.append(backend.forward(q, k, v, cache.clone(), meta, 0.125, window, **kwargs))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=0)


def test_a_dominant_sink_silences_its_head():
    """A sink far above every score takes all of the softmax: that head's output is zero, the
    others' untouched."""
    cache, tables, q, k, v, qlens, seqs, _ = _step(torch.float32, 6, 2, "mixed")
    sinks = torch.full((6,), float("-inf"))
    sinks[4] = 1e4
    for name in ("reference", "sdpa", "paged"):
        backend = get_backend(name)
        got = backend.forward(q, k, v, cache.clone(), backend.build_metadata(qlens, seqs, tables, 16), 0.125, None,
                              sinks=sinks).view(-1, 6, 64)
        plain = backend.forward(q, k, v, cache.clone(), backend.build_metadata(qlens, seqs, tables, 16), 0.125,
                                None).view(-1, 6, 64)
        assert torch.equal(got[:, 4], torch.zeros_like(got[:, 4])), name
        torch.testing.assert_close(got[:, :4], plain[:, :4], atol=1e-6, rtol=0)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), lens=st.lists(st.integers(1, 70), min_size=1, max_size=4),
       chunk=st.integers(1, 8), window=st.sampled_from([None, 5, 32]), spread=st.floats(0.0, 8.0),
       name=st.sampled_from(["sdpa", "paged"]))
def test_sinks_property(seed, lens, chunk, window, spread, name):
    """Any mix of requests, the last `chunk` tokens of each (at most its length) this step's
    queries, and sinks of any spread: the backend is transformers' formula."""
    qlens = [min(chunk, n) for n in lens]
    order = sorted(range(len(lens)), key=lambda i: qlens[i] != 1)  # decodes first
    qlens, seqs = [qlens[i] for i in order], [lens[i] for i in order]
    cache, tables, q, k, v = _case(torch.float32, hq=6, hkv=2, d=32, lens=tuple(seqs), seed=seed,
                                   tokens=sum(qlens))
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(seed)) * spread
    want = sink_reference(q, k, v, cache, tables, qlens, seqs, 16, 32 ** -0.5, window, sinks)
    backend = get_backend(name)
    got = backend.forward(q, k, v, cache, backend.build_metadata(qlens, seqs, tables, 16), 32 ** -0.5, window,
                          sinks=sinks)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 4e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("name", ["paged", "sdpa"])
def test_sinks_over_an_int8_cache(name, dtype, atol, window):
    """The int8 decode kernel (paged) and sdpa's dequantized reads against the reference loop on the
    same quantized cache: decodes, then a chunk over cached context beside a decode."""
    bs, d, hq, hkv = 16, 64, 6, 2
    gen = torch.Generator().manual_seed(11)
    k0, v0 = (torch.randn(60, hkv, d, generator=gen).to(dtype) for _ in range(2))
    q0 = torch.randn(61, hq, d, generator=gen).to(dtype)
    sinks = torch.randn(hq, generator=gen) * 3
    outs = []
    for backend in (get_backend(name, "int8"), ReferenceBackend("int8")):
        cache = backend.allocate(1, 8, bs, hkv, d, dtype)[0]
        table = [5, 2, 7, 0]
        meta = backend.build_metadata([40], [40], [table], bs)
        backend.forward(q0[:40], k0[:40], v0[:40], cache, meta, 0.125, window, sinks=sinks)
        step = []
        for n in range(40, 43):  # three decode steps
            meta = backend.build_metadata([1], [n + 1], [table], bs)
            step.append(backend.forward(q0[n:n + 1], k0[n:n + 1], v0[n:n + 1], cache, meta, 0.125, window,
                                        sinks=sinks))
        meta = backend.build_metadata([1, 17], [1, 60], [[6], table], bs)
        k, v = torch.cat([k0[59:60], k0[43:60]]), torch.cat([v0[59:60], v0[43:60]])
        step.append(backend.forward(q0[43:61], k, v, cache, meta, 0.125, window, sinks=sinks))
        outs.append(torch.cat(step).float())
    torch.testing.assert_close(outs[0], outs[1], atol=atol, rtol=0)


@pytest.mark.parametrize("name", ["reference", "sdpa", "paged"])
def test_sinks_with_softcap_are_refused(name):
    cache, tables, q, k, v, qlens, seqs, sinks = _step(torch.float32, 6, 2, "mixed")
    backend = get_backend(name)
    with pytest.raises(ValueError, match="soft-cap"):
        backend.forward(q, k, v, cache, backend.build_metadata(qlens, seqs, tables, 16), 0.125, None, softcap=30.0,
                        sinks=sinks)


def test_sinks_must_be_one_per_query_head():
    cache, tables, q, k, v, qlens, seqs, _ = _step(torch.float32, 6, 2, "decodes")
    for name in ("sdpa", "paged"):
        backend = get_backend(name)
        with pytest.raises(ValueError, match="one logit per query head"):
            backend.forward(q, k, v, cache, backend.build_metadata(qlens, seqs, tables, 16), 0.125, None,
                            sinks=torch.zeros(2))


def test_the_layer_hands_its_sinks_to_the_backend():
    cache, tables, q, k, v, qlens, seqs, sinks = _step(torch.float32, 6, 2, "mixed")
    backend = get_backend("sdpa")
    layer = Attention(6, 64, 0.125, 2, sliding_window=8)
    got = layer(q, k, v, cache.clone(), backend.build_metadata(qlens, seqs, tables, 16), sinks=sinks)
    want = sink_reference(q, k, v, cache, tables, qlens, seqs, 16, 0.125, 8, sinks)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    encoder = Attention(6, 64, 0.125, 2, causal=False)
    with pytest.raises(ValueError, match="causal"):
        encoder(q, k, v, None, backend.build_metadata(qlens, seqs, tables, 16), sinks=sinks)


needs_bf16_kernel = pytest.mark.skipif(library.available() is not None or not capabilities.bf16_matmuls(),
                                       reason="the prefill kernel needs AVX512-BF16")


@needs_bf16_kernel
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (12, 2, 128), (8, 8, 32), (16, 1, 64)])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("qlens, seq", [([1, 1, 250, 37, 1], [30, 90, 250, 37, 1]), ([77, 3, 130], [177, 8, 130])])
def test_prefill_kernel_with_sinks(hq, hkv, d, window, qlens, seq):
    """prefill_attention.c's online softmax started at the sink, on the paged backend's bfloat16 path."""
    cache, tables, _, _, _ = _case(torch.bfloat16, hq=hq, hkv=hkv, d=d, lens=tuple(seq))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(qlens), h, d, generator=gen).to(torch.bfloat16) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=gen) * 3
    backend = get_backend("paged")
    got = backend.forward(q, k, v, cache.clone(), backend.build_metadata(qlens, seq, tables, 16), d ** -0.5, window,
                          sinks=sinks)
    assert backend._prefill_c  # the kernel ran (no fallback to sdpa's path)
    want = sink_reference(q, k, v, cache, tables, qlens, seq, 16, d ** -0.5, window, sinks)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("d", [64, 32, 48])  # the decode kernel's AVX2 loops and its generic one
def test_decode_kernel_takes_sinks(dtype, atol, d):
    """paged_attention.c directly: the maximum starts at the sink, the sum gains exp(sink - max)."""
    lens = [1, 17, 40, 300]
    cache, tables, q, _, _ = _case(dtype, d=d, lens=tuple(lens))
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(4)) * 3
    table = torch.tensor([t + [0] * (19 - len(t)) for t in tables])
    got = attention_ops.paged_decode_attention(q, cache, table, torch.tensor(lens), max(lens), 0.125, 8, sinks=sinks)
    # the "step's" keys and values: what the cache already holds at each last position
    k, v = (torch.stack([cache[i, :, t[-1], (n - 1) % 16] for t, n in zip(tables, lens)]) for i in (0, 1))
    want = sink_reference(q, k, v, cache, tables, [1] * 4, lens, 16, 0.125, 8, sinks)
    torch.testing.assert_close(got.float().view(4, -1), want, atol=atol, rtol=0)
