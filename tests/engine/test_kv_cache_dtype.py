"""The int8 KV cache (`--kv-cache-dtype int8`): block format, kernels against the reference loop,
capacity, and the engine's invariances (batching, chunking, prefix hits, preemption) with it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.kernels import attention_ops, library
from tessera.attention import get_backend
from tessera.attention.base import read_blocks
from tessera.attention.reference import ReferenceBackend
from tessera.errors import ConfigError
from tessera.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(library.available() is not None, reason="C kernels unavailable here")


def _scales(cache: torch.Tensor) -> torch.Tensor:
    return cache[..., -4:].contiguous().view(torch.float32)[..., 0]  # [2, Hkv, blocks]


def _write(cache, k, v, slots, block_size, chunks):
    """Write rows in consecutive chunks, as successive engine steps would."""
    at = 0
    for n in chunks:
        attention_ops.kv_write_int8(cache, k[at:at + n], v[at:at + n], slots[at:at + n], block_size)
        at += n


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), cuts=st.lists(st.integers(1, 40), min_size=1, max_size=6),
       d=st.sampled_from([16, 64, 128]))
def test_block_contents_do_not_depend_on_how_writes_are_split(seed, cuts, d):
    """A block's bytes (rows and scale) are a function of its rows in order, not of the steps."""
    gen = torch.Generator().manual_seed(seed)
    bs, hkv, t = 16, 2, 64
    k = torch.randn(t, hkv, d, generator=gen) * torch.rand(t, 1, 1, generator=gen) * 4
    v = torch.randn(t, hkv, d, generator=gen)
    slots = torch.randperm(8, generator=gen)[:4].repeat_interleave(bs) * bs + torch.arange(bs).repeat(4)
    backend = get_backend("reference", "int8")
    whole = backend.allocate(1, 8, bs, hkv, d, torch.float32)[0]
    split = whole.clone()
    _write(whole, k, v, slots, bs, [t])
    chunks = [c for c in cuts if c > 0]
    rest = t - sum(chunks)
    chunks = chunks + [rest] if rest > 0 else chunks
    while sum(chunks) > t:
        chunks[-1] -= sum(chunks) - t
        chunks = [c for c in chunks if c > 0]
    _write(split, k, v, slots, bs, chunks)
    assert torch.equal(whole, split)


def test_rows_round_trip_within_their_block_step():
    gen = torch.Generator().manual_seed(0)
    bs, hkv, d, t = 16, 2, 64, 48
    # Rows of decreasing size: the first row of each block sets the scale, no growth re-rounding.
    mags = torch.linspace(3, 1, bs).repeat(t // bs).view(t, 1, 1)
    k, v = (torch.randn(t, hkv, d, generator=gen) for _ in range(2))
    k, v = (x / x.abs().amax(dim=-1, keepdim=True) * mags for x in (k, v))
    backend = get_backend("reference", "int8")
    cache = backend.allocate(1, 3, bs, hkv, d, torch.float32)[0]
    _write(cache, k, v, torch.arange(t), bs, [t])
    got = read_blocks(cache, torch.arange(3), bs, torch.float32)  # [2, Hkv, 3, bs, d]
    want = torch.stack([k, v]).view(2, 3, bs, hkv, d).permute(0, 3, 1, 2, 4)
    step = _scales(cache).view(2, hkv, 3, 1, 1)
    assert torch.all((got - want).abs() <= step * 0.5 + 1e-6)
    amax = want.abs().amax(dim=(-1, -2), keepdim=True)
    torch.testing.assert_close(step, amax / 127)
    # Growth: a larger row later in a block raises its scale and re-rounds the earlier rows.
    k2 = k.clone()
    k2[5] *= 10
    cache2 = backend.allocate(1, 3, bs, hkv, d, torch.float32)[0]
    _write(cache2, k2, v, torch.arange(t), bs, [t])
    got2 = read_blocks(cache2, torch.arange(1), bs, torch.float32)[0, :, 0]  # keys of block 0
    step2 = _scales(cache2)[0, :, 0].view(hkv, 1, 1)
    torch.testing.assert_close(step2.view(-1), k2[:16].abs().amax(dim=(0, 2)) / 127)
    assert torch.all((got2 - k2[:16].transpose(0, 1)).abs() <= step2 + 1e-6)  # two roundings at most


def _case(bs, d, hq, hkv, lens, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // bs) for n in lens) + 2
    order = torch.randperm(nb, generator=gen).tolist()
    tables, pos = [], 0
    for n in lens:
        tables.append(order[pos:pos + -(-n // bs)])
        pos += -(-n // bs)
    t = sum(lens)
    k, v = (torch.randn(t, hkv, d, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    qlens, seqs, tabs = [], [], []
    for table, n in zip(tables, lens):
        qlens += [1] * n
        seqs += list(range(1, n + 1))
        tabs += [table] * n
    return nb, q, k, v, qlens, seqs, tabs


@pytest.mark.parametrize("bs, d, hq, hkv", [(16, 64, 6, 2), (32, 128, 12, 2), (8, 64, 9, 3), (16, 48, 4, 1)])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 4e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_kernel_matches_reference_on_the_same_int8_cache(bs, d, hq, hkv, dtype, atol, window):
    """Vector path (block size % 16, head dim % 32) and plain loops (the others) against the loop;
    the kernel rounds q and the softmax weights to int16, far below the cache's own error."""
    nb, q, k, v, qlens, seqs, tabs = _case(bs, d, hq, hkv, (1, 17, 40, 200), dtype)
    outs = []
    for backend in (get_backend("paged", "int8"), ReferenceBackend("int8")):
        cache = backend.allocate(1, nb, bs, hkv, d, dtype)[0]
        meta = backend.build_metadata(qlens, seqs, tabs, bs)
        outs.append(backend.forward(q, k, v, cache, meta, d ** -0.5, window).float())
    torch.testing.assert_close(outs[0], outs[1], atol=atol, rtol=0)


@pytest.mark.parametrize("name", ["paged", "sdpa"])
def test_prefill_chunks_over_an_int8_cache_match_reference(name):
    bs, d, hq, hkv = 16, 64, 6, 2
    nb, _, k0, v0, _, _, _ = _case(bs, d, hq, hkv, (60,), torch.float32)
    gen = torch.Generator().manual_seed(3)
    outs = []
    for backend in (get_backend(name, "int8"), ReferenceBackend("int8")):
        cache = backend.allocate(1, 8, bs, hkv, d, torch.float32)[0]
        table = [5, 2, 7, 0]
        # 40 tokens of context first, then a 20-token chunk and one decode row of another request.
        meta = backend.build_metadata([40], [40], [table], bs)
        backend.forward(torch.randn(40, hq, d, generator=torch.Generator().manual_seed(1)), k0[:40], v0[:40],
                        cache, meta, 0.125, None)
        meta = backend.build_metadata([1, 20], [1, 60], [[6], table], bs)
        q = torch.randn(21, hq, d, generator=gen)
        k, v = torch.cat([k0[59:60], k0[40:60]]), torch.cat([v0[59:60], v0[40:60]])
        outs.append(backend.forward(q, k, v, cache, meta, 0.125, None))
        gen = torch.Generator().manual_seed(3)
    torch.testing.assert_close(outs[0], outs[1], atol=4e-3, rtol=0)


def test_int8_holds_twice_the_tokens():
    bf16, int8 = get_backend("paged", "auto"), get_backend("paged", "int8")
    for d in (64, 128, 256):
        a = bf16.bytes_per_block(30, 3, d, 16, torch.bfloat16)
        b = int8.bytes_per_block(30, 3, d, 16, torch.bfloat16)
        assert b == 30 * 2 * 3 * (16 * d + 4)  # data + one float32 scale per (K/V, head, block)
        assert a / b > 1.99
    cache = int8.allocate(2, 5, 16, 3, 64, torch.bfloat16)
    assert cache[0].dtype == torch.int8 and sum(c.nbytes for c in cache) == 5 * int8.bytes_per_block(
        2, 3, 64, 16, torch.bfloat16)


def test_bad_kv_cache_dtype_and_block_size_are_refused():
    from tessera.config import EngineConfig

    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="even --block-size"):
        get_backend("paged", "int8").allocate(1, 2, 15, 2, 64, torch.float32)


# -- the engine with an int8 cache --------------------------------------------------------------
#
# Exact invariances hold where the same keys and values reach the cache bit for bit: any batch of
# decodes (each row is computed alone) and swapping (blocks are copied with their scales). A prompt
# computed in other chunks (chunked prefill, a prefix hit, recomputation after preemption) gets keys
# that differ from the float ones in the last bits (matrix products of other shapes), and rounding to
# int8 turns a few of those into whole steps: there the bound is that such noise stays below the
# quantization error itself.

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from tessera.models.loader import load_model

    from tiny_model import make_tiny_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama"), "float32")


def _llm(loaded, **opts):
    from tessera.llm import LLM

    opts.setdefault("max_model_len", 256)
    return LLM(str(loaded.path), loaded=loaded, kv_cache_dtype="int8", **opts)


def _prompts(n, seed=0):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(1, 70))] for _ in range(n)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def alone(loaded):
    llm = _llm(loaded)
    return [_tokens(llm.generate([p], GREEDY))[0] for p in _prompts(16)]


def test_engine_int8_batch_matches_alone(loaded, alone):
    assert _tokens(_llm(loaded).generate(_prompts(16), GREEDY)) == alone


def test_engine_int8_swap_preemption_matches_alone(loaded, alone):
    per_block = 2 * 2 * 2 * (16 * 16 + 4)  # K/V x 2 layers x 2 KV heads x (16 tokens x head dim 16 + scale)
    llm = _llm(loaded, kv_cache_memory=8 * per_block, preemption_mode="swap", max_model_len=128)
    assert llm.engine.kv.num_blocks == 8
    ps = [p for p in _prompts(16) if len(p) + 24 <= 128]
    want = [a for p, a in zip(_prompts(16), alone) if len(p) + 24 <= 128]
    assert _tokens(llm.generate(ps, GREEDY)) == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_engine_int8_recompute_prefix_hits_and_chunks_run_and_free_everything(loaded):
    per_block = 2 * 2 * 2 * (16 * 16 + 4)
    llm = _llm(loaded, kv_cache_memory=8 * per_block, preemption_mode="recompute", max_model_len=128,
               max_num_batched_tokens=7, max_num_seqs=5)
    head = _prompts(1, seed=7)[0][:30]
    outs = llm.generate([head + p[:20] for p in _prompts(10)], GREEDY)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.prefix_cache_hits > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def _logits(loaded, kv_dtype: str, ids: list[int], chunk: int) -> torch.Tensor:
    c = loaded.config
    backend = get_backend("paged", kv_dtype)
    caches = backend.allocate(c.num_layers, 8, 16, c.num_kv_heads, c.head_dim, loaded.dtype)
    table, out = [3, 1, 4, 0, 5], []
    with torch.inference_mode():
        for s in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - s)
            meta = backend.build_metadata([n], [s + n], [table], 16)
            out.append(loaded.model.compute_logits(loaded.model(torch.tensor(ids[s:s + n]), torch.arange(s, s + n),
                                                                caches, meta)))
    return torch.cat(out)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_chunked_prefill_over_int8_differs_less_than_the_quantization(loaded, seed):
    ids = _prompts(1, seed=seed)[0] + _prompts(1, seed=seed + 10)[0]
    ids = (ids * 3)[:75]
    exact = _logits(loaded, "auto", ids, 75)
    whole = _logits(loaded, "int8", ids, 75)
    for chunk in (7, 16, 33):
        chunked = _logits(loaded, "int8", ids, chunk)
        assert (chunked - whole).abs().max() <= (whole - exact).abs().max()
        assert (chunked.argmax(-1) == whole.argmax(-1)).float().mean() >= 0.9


def test_stats_report_int8_capacity(loaded):
    info = _llm(loaded).engine.kv_cache_info()
    assert info["dtype"] == "int8" and info["tokens"] == info["num_blocks"] * 16
    assert info["tokens_per_gib"] == pytest.approx(16 * 2**30 / (2 * 2 * 2 * (16 * 16 + 4)), rel=1e-3)


@pytest.mark.parametrize("layout", ["decode-12", "decode-100", "prefill"])  # kernels / matrix products / SDPA
def test_key_bias_share_is_kept_out_of_an_int8_cache_and_added_back(layout):
    """Keys RoPE_p(u + b) with a few bias channels 100x the rest (Qwen2's shape): the paged backend
    (write and decode kernels, or matrix products and the prefill path) and the reference loop agree
    on the same int8 cache, and with the bias share taken out the result is several times closer to
    exact float attention than rounding the whole keys; float caches ignore the key bias."""
    from tessera.attention.base import KeyBias
    from tessera.layers import RotaryEmbedding, apply_rope
    from tessera.layers.attention import Attention

    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, bs = 4, 2, 64, 16
    rows = 100 if layout != "decode-12" else 12
    bias = torch.randn(hkv, d, generator=gen)
    bias[0, [3, 3 + d // 2]] = torch.tensor([300.0, 200.0])
    bias[1, 10] = -400.0
    rotary = RotaryEmbedding(d, 10000.0, None, 512, torch.float32)
    lens = [rows // 2, rows - rows // 2]
    if layout == "prefill":
        qlens, seqs, tabs = lens, lens, [[0, 1, 2, 3], [4, 5, 6, 7]]
        positions = torch.cat([torch.arange(n) for n in lens])
    else:
        qlens, seqs, tabs = [], [], []
        for n, t in zip(lens, [[0, 1, 2, 3], [4, 5, 6, 7]]):
            qlens += [1] * n
            seqs += list(range(1, n + 1))
            tabs += [t] * n
        positions = torch.tensor(seqs) - 1
    cos, sin = rotary(positions)
    q = apply_rope(torch.randn(rows, hq, d, generator=gen), cos, sin, d // 2)
    k = apply_rope(torch.randn(rows, hkv, d, generator=gen) + bias, cos, sin, d // 2)
    v = torch.randn(rows, hkv, d, generator=gen)
    lo, hi, pairs = KeyBias.outliers(bias.flatten(), hkv, d)
    where = [{p: i for i, p in enumerate(row)} for row in pairs.tolist()]  # per KV head
    assert lo[0, where[0][3]] == 300 and hi[0, where[0][3]] == 200 and lo[1, where[1][10]] == -400
    norms = torch.sqrt(bias[:, :d // 2] ** 2 + bias[:, d // 2:] ** 2)
    for h in range(hkv):  # a pair is taken out where its norm is over the head's median, else left in the keys
        taken = norms[h] > norms[h].median()
        assert len(where[h]) == pairs.shape[1]  # each head's pairs are distinct
        assert [p for p in range(d // 2) if p in where[h] and (lo[h, where[h][p]] != 0 or hi[h, where[h][p]] != 0)] \
            == taken.nonzero().flatten().tolist()
    key_bias = KeyBias.for_layer(bias.flatten(), hkv, d, rotary.inv_freq, rotary.exact_cos_sin)
    assert torch.equal(key_bias.pairs, pairs) and torch.equal(key_bias.lo, lo)
    # Its share of each key is RoPE_p of the bias on those pairs.
    outlier = torch.zeros(hkv, d)
    for h in range(hkv):
        outlier[h, pairs[h]], outlier[h, d // 2 + pairs[h]] = lo[h], hi[h]
    cos40, sin40 = rotary(torch.arange(40))
    # (float32 tables' angles are rounded: 1e-6 relative at 40 positions)
    torch.testing.assert_close(key_bias.at(torch.arange(40)), apply_rope(outlier.expand(40, -1, -1), cos40, sin40, d // 2),
                               atol=2e-3, rtol=1e-5)
    layer = Attention(hq, d, 0.125, hkv)

    def run(backend, kb):
        cache = backend.allocate(1, 8, bs, hkv, d, torch.float32)[0]
        return layer(q, k, v, cache, backend.build_metadata(qlens, seqs, tabs, bs), kb)

    exact = run(get_backend("paged", "auto"), None)
    assert torch.equal(run(get_backend("paged", "auto"), key_bias), exact)
    paged = run(get_backend("paged", "int8"), key_bias)
    torch.testing.assert_close(paged, run(ReferenceBackend("int8"), key_bias), atol=5e-3, rtol=0)
    with_share = (paged - exact).abs().max().item()
    whole = (run(get_backend("paged", "int8"), None) - exact).abs().max().item()
    assert with_share < whole / 4, (with_share, whole)


@pytest.mark.parametrize("bs", [16, 6])  # the vector path; the plain loops (block size not a multiple of 16)
def test_decode_kernel_key_bias_term_holds_at_long_context(bs):
    """The decode kernel makes each chunk's cos/sin by rotating the previous chunk's, re-anchored
    every 1,024 positions: at 2,500 tokens (past two anchors) with a bias pair 400x the rest, its
    result matches the reference loop on the same int8 cache (exact float64 angles)."""
    from tessera.attention.base import KeyBias
    from tessera.layers import RotaryEmbedding, apply_rope
    from tessera.layers.attention import Attention

    gen = torch.Generator().manual_seed(9)
    hq, hkv, d, n = 4, 2, 64, 2500
    bias = torch.randn(hkv, d, generator=gen)
    bias[0, [3, 3 + d // 2]] = torch.tensor([300.0, 200.0])
    bias[1, 30] = -400.0  # the lowest frequency pair: its angle moves slowest
    bias[1, 1] = 250.0  # a fast one
    rotary = RotaryEmbedding(d, 1e6, None, 4096, torch.float32)
    key_bias = KeyBias.for_layer(bias.flatten(), hkv, d, rotary.inv_freq, rotary.exact_cos_sin)
    positions = torch.arange(n)
    # The rotary's cached table (grown past its first 4,096 rows) gives what float64 angles give.
    far = torch.tensor([0, 17, n - 1, 5000])
    angles = far.double().unsqueeze(1) * rotary.inv_freq.double()
    c, s = rotary.exact_cos_sin(far)
    assert torch.equal(c, angles.cos().float()) and torch.equal(s, angles.sin().float())
    cos, sin = rotary(positions)
    q = apply_rope(torch.randn(n, hq, d, generator=gen), cos, sin, d // 2)
    k = apply_rope(torch.randn(n, hkv, d, generator=gen) + bias, cos, sin, d // 2)
    v = torch.randn(n, hkv, d, generator=gen)
    layer = Attention(hq, d, 0.125, hkv)
    table = list(range(-(-n // bs)))
    outs = {}
    for name, backend in (("paged", get_backend("paged", "int8")), ("reference", ReferenceBackend("int8"))):
        cache = backend.allocate(1, len(table), bs, hkv, d, torch.float32)[0]
        prefill = get_backend("paged", "int8").build_metadata([n - 1], [n - 1], [table], bs)
        layer(q[:-1], k[:-1], v[:-1], cache, prefill, key_bias)  # the same int8 cache for both
        meta = backend.build_metadata([1], [n], [table], bs)
        outs[name] = layer(q[-1:], k[-1:], v[-1:], cache, meta, key_bias)
    torch.testing.assert_close(outs["paged"], outs["reference"], atol=5e-3, rtol=0)


@pytest.mark.parametrize("rows", ["decode", "prefill"])
def test_qwen2_key_bias_outliers_do_not_cost_an_int8_cache_its_precision(tiny_model_dir, rows):
    """A tiny Qwen2 whose key bias has one pair 100x the rest (the real models' shape): its logits over
    an int8 cache stay several times closer to the float cache's than when the whole keys are rounded
    (the layers' outlier pairs forced off), through the decode kernel and the prefill path alike."""
    from tessera.models.loader import load_model

    loaded = load_model(tiny_model_dir("qwen2"), "float32")
    c = loaded.config
    with torch.no_grad():
        for layer in loaded.model.model.layers:
            a = layer.self_attn
            a.qkv_proj.bias[a.q_size + 5] = 80.0
            a.qkv_proj.bias[a.q_size + 5 + c.head_dim // 2] = -60.0
    n, bs = 60, 16
    ids = torch.tensor([(7 * i) % 290 + 3 for i in range(n)])
    table = list(range(-(-n // bs)))

    def logits(kv_dtype: str) -> torch.Tensor:
        backend = get_backend("paged", kv_dtype)
        caches = backend.allocate(c.num_layers, len(table), bs, c.num_kv_heads, c.head_dim, torch.float32)
        if rows == "decode":
            meta = backend.build_metadata([1] * n, list(range(1, n + 1)), [table] * n, bs)
        else:
            meta = backend.build_metadata([n], [n], [table], bs)
        with torch.inference_mode():
            return loaded.model.compute_logits(loaded.model(ids, torch.arange(n), caches, meta))

    exact = logits("auto")
    with_share = (logits("int8") - exact).abs().max().item()
    for layer in loaded.model.model.layers:
        assert layer.self_attn._key_bias  # the boosted pair was found
        layer.self_attn._key_bias = False
    whole = (logits("int8") - exact).abs().max().item()
    assert with_share < whole / 3, (with_share, whole)
