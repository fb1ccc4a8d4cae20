"""Engine behaviour on a tiny random model: batching must never change greedy output."""
from __future__ import annotations

import random

import pytest

from tessera.llm import LLM
from tessera.sampling_params import InvalidRequestError, SamplingParams

from tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from tessera.models.loader import load_model

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")
    return load_model(folder, "float32")


def make_llm(loaded, **opts) -> LLM:
    opts.setdefault("max_model_len", 256)
    return LLM(str(loaded.path), loaded=loaded, **opts)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(1, 70))] for _ in range(n)]


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def texts(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def alone(loaded):
    llm = make_llm(loaded)
    return [texts(llm.generate([p], GREEDY))[0] for p in prompts(32)]


@pytest.mark.slow
def test_batch_of_32_matches_alone(loaded, alone):
    assert texts(make_llm(loaded).generate(prompts(32), GREEDY)) == alone


@pytest.mark.slow
def test_chunked_prefill_tiny_budget_matches(loaded, alone):
    llm = make_llm(loaded, max_num_batched_tokens=7, max_num_seqs=5)
    assert texts(llm.generate(prompts(32), GREEDY)) == alone


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches(loaded, alone, mode):
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 16  # 2 layers, 2 kv heads, head_dim 16, fp32, 16 tokens
    llm = make_llm(loaded, kv_cache_memory=8 * bytes_per_block, preemption_mode=mode,
                   max_model_len=128)
    ps = [p for p in prompts(32) if len(p) + 24 <= 128]
    want = [a for p, a in zip(prompts(32), alone) if len(p) + 24 <= 128]
    assert texts(llm.generate(ps, GREEDY)) == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.slow
def test_prefix_cache_hits_match(loaded, alone):
    llm = make_llm(loaded)
    head = prompts(1, seed=7)[0] * 3
    ps = [head + p for p in prompts(8)]
    first = texts(llm.generate(ps, GREEDY))
    assert llm.engine.kv.prefix_cache_hits > 0  # siblings after the first found the head
    hits_before = llm.engine.kv.prefix_cache_hits
    again = texts(llm.generate(ps, GREEDY))
    assert llm.engine.kv.prefix_cache_hits > hits_before
    no_cache = texts(make_llm(loaded, enable_prefix_caching=False).generate(ps, GREEDY))
    assert first == again == no_cache


@pytest.mark.slow
def test_static_policy_matches(loaded, alone):
    llm = make_llm(loaded, scheduler_policy="static", max_num_seqs=8)
    assert texts(llm.generate(prompts(32), GREEDY)) == alone


def test_seeded_sampling_is_reproducible_in_any_batch(loaded):
    p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    llm = make_llm(loaded)
    solo = texts(llm.generate([prompts(1)[0]], p))[0]
    others = SamplingParams(max_tokens=20, temperature=1.3, ignore_eos=True)
    mixed = llm.generate([prompts(1)[0]] + prompts(6, seed=3), [p] + [others] * 6)
    assert texts(mixed)[0] == solo
    different = texts(llm.generate([prompts(1)[0]], SamplingParams(
        max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True)))[0]
    assert different != solo


def test_n_samples_share_prompt_blocks(loaded):
    llm = make_llm(loaded)
    prompt = prompts(1, seed=5)[0] * 2  # > 1 full block
    out = llm.generate([prompt], SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=3,
                                                ignore_eos=True))[0]
    assert len(out.outputs) == 4 and [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 10 for o in out.outputs)
    assert llm.engine.kv.prefix_cache_hits >= 3 * (len(prompt) - 1) // 16 * 16
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_stop_strings_and_tokens(loaded):
    llm = make_llm(loaded)
    p = prompts(1)[0]
    full = llm.generate([p], GREEDY)[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = llm.generate([p], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == full.text[: full.text.find(stop)]
    tok = full.token_ids[5]
    out = llm.generate([p], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[tok]))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids[-1] == tok
    assert full.finish_reason == "length" and len(full.token_ids) == 24


def test_logprobs(loaded):
    llm = make_llm(loaded)
    o = llm.generate([prompts(1)[0]], SamplingParams(max_tokens=5, temperature=0, logprobs=3,
                                                     ignore_eos=True))[0].outputs[0]
    assert len(o.logprobs) == 5
    for tok, lp in zip(o.token_ids, o.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0][0] == tok and abs(lp.top[0][2] - lp.logprob) < 1e-6  # greedy = best
        assert lp.logprob <= 0


def test_invalid_requests_are_rejected_at_once(loaded):
    llm = make_llm(loaded, max_model_len=64)
    e = llm.engine
    with pytest.raises(InvalidRequestError):
        e.add_request("a", [1] * 64, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError):
        e.add_request("b", [1] * 10, SamplingParams(max_tokens=60))
    with pytest.raises(InvalidRequestError):
        e.add_request("c", "", SamplingParams())
    with pytest.raises(InvalidRequestError):
        e.add_request("d", [10**9], SamplingParams())
    with pytest.raises(InvalidRequestError):
        SamplingParams(temperature=-1)
    assert not e.has_unfinished_requests()


def test_abort_frees_blocks(loaded):
    llm = make_llm(loaded)
    e = llm.engine
    for i, p in enumerate(prompts(10)):
        e.add_request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        e.step()
    assert e.kv.num_free_blocks < e.kv.num_blocks
    for i in range(10):
        e.abort_request(f"r{i}")
    outs = e.step()
    assert {o.request_id for o in outs} == {f"r{i}" for i in range(10)}
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert not e.has_unfinished_requests()
    assert e.kv.num_free_blocks == e.kv.num_blocks


def test_reference_and_sdpa_backends_agree(loaded, alone):
    llm = make_llm(loaded, attention_backend="reference", max_num_batched_tokens=13)
    assert texts(llm.generate(prompts(32)[:8], GREEDY)) == alone[:8]


@pytest.mark.slow
def test_triton_backend_agrees(loaded, alone):
    """The GPU's attention kernel (in Triton's interpreter here) through the whole engine: mixed
    decode and chunked-prefill steps over cached blocks give the paged backend's greedy tokens."""
    llm = make_llm(loaded, attention_backend="triton", max_num_batched_tokens=13)
    assert llm.engine.parts.attn_backend.name == "triton"
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)  # the interpreter is slow
    assert texts(llm.generate(prompts(32)[:4], short)) == [t[:8] for t in alone[:4]]


PENALTIES = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                           frequency_penalty=0.6, presence_penalty=0.4)


def test_repetition_penalty_reads_the_whole_prompt_and_output(loaded):
    """The runner's history of a request is its every token: prefix-cache hits (never fed to the
    runner) and output alike. Token by token, a fresh request over the same tokens (a repetition
    penalty reads prompt and output alike) picks the same next token."""
    rep = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.8)
    llm = make_llm(loaded)
    prompt = (prompts(1, seed=3)[0] * 60)[:60]  # repeats, and fills whole blocks for the prefix cache
    got = texts(llm.generate([prompt], rep))[0]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, repetition_penalty=1.8)
    ref: list[int] = []
    for _ in range(10):
        ref += texts(llm.generate([prompt + ref], one))[0]
    assert got == ref
    assert llm.engine.kv.prefix_cache_hits > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_penalties_survive_batching_and_preemption(loaded, mode):
    """Penalised greedy text is the request's alone whatever else runs and however often it is
    preempted (the runner drops its history then and is sent it again on resuming), and the runner
    keeps no history of a finished request."""
    ps = [p for p in prompts(12) if len(p) + 16 <= 128]
    llm = make_llm(loaded, max_model_len=128)
    alone = [texts(llm.generate([p], PENALTIES))[0] for p in ps]
    assert alone != texts(llm.generate(ps, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)))
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 16  # as test_preemption_matches
    small = make_llm(loaded, kv_cache_memory=6 * bytes_per_block, preemption_mode=mode, max_model_len=128)
    assert texts(small.generate(ps, PENALTIES)) == alone
    assert small.engine.scheduler.num_preemptions > 0
    small.engine.step()  # the last finished requests are reported with the next step
    assert len(small.engine.runner.histories) == 0
