"""Sliding-window layers keep only their window's blocks (attention/kv_groups.py): the same greedy
output as keeping every block, in fewer blocks, through chunked prefill, prefix hits and preemption.

The tiny Gemma 3 has two sliding layers (window 6) and one full one: one full-attention group and
two sliding groups of one layer each; blocks of 2 tokens put most of a 40-token context behind the
window."""
from __future__ import annotations

import random

import pytest

from tessera.attention.kv_groups import NULL_BLOCK, KVCacheGroups
from tessera.engine.core.request import Request
from tessera.llm import LLM
from tessera.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma(tiny_model_dir):
    from tessera.models.loader import load_model

    return load_model(tiny_model_dir("gemma3"), "float32")


def make_llm(loaded, **opts) -> LLM:
    opts.setdefault("max_model_len", 128)
    opts.setdefault("block_size", 2)
    return LLM(str(loaded.path), loaded=loaded, **opts)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(3, 45))] for _ in range(n)]


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_gemma3_270m_layers_make_six_groups_of_three() -> None:
    windows = ([512] * 5 + [None]) * 3
    g = KVCacheGroups.for_layers(windows)
    assert g.windows == (None,) + (512,) * 5 and g.num_slots == 3
    for group in range(g.num_groups):  # one layer of each group in each slot, of the group's kind
        layers = [i for i in range(18) if g.layer_group[i] == group]
        assert sorted(g.layer_slot[i] for i in layers) == [0, 1, 2]
        assert {windows[i] for i in layers} == {g.windows[group]}
    # 4,096 tokens in blocks of 16: 256 full blocks + 5 x 34 sliding ones, against 6 x 256.
    assert g.blocks_per_sequence(4096, 16) == 256 + 5 * 34
    assert KVCacheGroups.for_layers(windows, hybrid=False) == KVCacheGroups.plain(18)
    assert not KVCacheGroups.for_layers([8, 8]).hybrid  # only sliding layers: kept plain
    assert not KVCacheGroups.for_layers([None, 8, 16]).hybrid  # two windows: kept plain


@pytest.mark.parametrize("opts", [
    {"attention_backend": "paged"},
    {"attention_backend": "sdpa"},
    {"attention_backend": "reference"},
    {"attention_backend": "triton"},  # the GPU's kernel, in Triton's interpreter
    {"attention_backend": "paged", "kv_cache_dtype": "int8"},
    {"attention_backend": "paged", "max_num_batched_tokens": 5, "max_num_seqs": 4},  # chunked prefill
])
@pytest.mark.slow
def test_same_greedy_output_as_whole_context_blocks(gemma, opts):
    ps = prompts(2 if opts["attention_backend"] == "triton" else 12)  # the interpreter is slow
    whole = token_ids(make_llm(gemma, disable_hybrid_kv_cache_manager=True, **opts).generate(ps, GREEDY))
    llm = make_llm(gemma, **opts)
    assert llm.engine.kv_groups.hybrid and llm.engine.kv_groups.num_groups == 3
    assert token_ids(llm.generate(ps, GREEDY)) == whole
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks - 1  # everything back but the reserved NULL_BLOCK


def test_blocks_behind_the_window_are_released(gemma):
    llm = make_llm(gemma)
    engine = llm.engine
    prompt = prompts(1, seed=3)[0] + list(range(10, 40))
    engine.add_request("r", prompt, GREEDY)
    for _ in range(12):
        engine.step()
    req = engine.scheduler.running[0]
    kv, groups = engine.kv, engine.kv_groups
    blocks = kv.blocks(req.request_id)
    sliding = [g for g, w in enumerate(groups.windows) if w is not None]
    first = groups.first_needed_block(sliding[0], req.num_computed_tokens, kv.block_size)
    assert blocks.num_null_blocks == first > 10
    for g in sliding:
        table = blocks.tables[g]
        assert len(table) == len(blocks.block_ids)
        assert table[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in table[first:]
    held = sum(len(t) for t in blocks.tables) - first * len(sliding)
    assert kv.num_blocks - 1 - kv.num_free_blocks == held
    # The full group still holds every block of the context.
    assert len(blocks.block_ids) == kv.blocks_for(req.num_tokens) and NULL_BLOCK not in blocks.block_ids


def test_prefix_hit_past_the_window(gemma):
    """A second turn reuses the first's blocks: the full group's from the start, the sliding
    groups' only within the window of the hit's end (older ones were released)."""
    first = prompts(1, seed=5)[0] + list(range(50, 90))
    outs = {}
    for hybrid in (True, False):
        llm = make_llm(gemma, disable_hybrid_kv_cache_manager=not hybrid)
        reply = token_ids(llm.generate([first], GREEDY))[0]
        second = llm.generate([first + reply + [7, 8, 9]], GREEDY)[0]
        outs[hybrid] = (reply, second.outputs[0].token_ids, second.num_cached_tokens)
    assert outs[True] == outs[False]
    assert outs[True][2] >= len(first)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_groups(gemma, mode):
    ps = [p for p in prompts(16, seed=9) if len(p) <= 40]
    alone = token_ids(make_llm(gemma).generate(ps, GREEDY))
    block = 2 * 1 * 2 * 32 * 4  # K and V, 1 KV head, 2 tokens, head dim 32, float32: one layer per block
    llm = make_llm(gemma, kv_cache_memory=90 * block, preemption_mode=mode, swap_space=400 * block,
                   max_num_batched_tokens=16, max_num_seqs=6)
    assert token_ids(llm.generate(ps, GREEDY)) == alone
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks - 1


def test_capacity_in_the_same_memory(gemma):
    """Same --kv-cache-memory: whole-context blocks hold a 128-token sequence once, groups fit
    more than one (the sliding layers hold ~8 tokens of it each)."""
    block = 2 * 1 * 2 * 32 * 4
    opts = dict(kv_cache_memory=200 * block, max_num_batched_tokens=8)
    plain = make_llm(gemma, disable_hybrid_kv_cache_manager=True, **opts).engine
    hybrid = make_llm(gemma, **opts).engine
    assert plain.kv.num_blocks == 200 // 3 and hybrid.kv.num_blocks == 200
    assert plain.kv_capacity_tokens == 66 * 2
    assert hybrid.kv_capacity_tokens > 2 * plain.kv_capacity_tokens
    per_seq = hybrid.kv_groups.blocks_per_sequence(128, 2)
    assert per_seq == 64 + 2 * min(64, -(-(6 + 1) // 2) + 1)
    r = Request("x", [5] * 127, GREEDY, 1, [0])
    assert hybrid.kv.allocate_slots(r, 127)  # a whole prompt at once: every group's blocks, then released
    hybrid.kv.free(r)
