"""Speculative decoding: proposals, the load policy, lossless verification, engine invariance."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import GREEDY, alone, loaded, make_llm, prompts, texts  # noqa: F401 (fixtures)
from tiny_model import make_tiny_model

from tessera.config import EngineConfig
from tessera.engine.core.scheduler_output import Proposal
from tessera.engine.core.spec_acceptance import PROBE_INTERVAL
from tessera.engine.spec_decode import (
    DraftInput, NgramProposer, SpeculationPolicy, SuffixProposer, default_draft_layers)
from tessera.engine.worker.sampler import Sampler
from tessera.errors import ConfigError
from tessera.sampling_params import SamplingParams
from tessera.speculative_config import SpeculativeConfig

# On at any batch and at every proposal's full length here: the invariance tests want the
# verification working (adaptive draft lengths would rightly stop it in a batch of 32).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64, "adaptive": False}


def _req(tokens: list[int], generator=None, **params):
    return SimpleNamespace(all_token_ids=tokens, params=SamplingParams(**params), generator=generator,
                           output_token_ids=[])


# ----------------------------------------------------------------------------- proposals and policy

def test_ngram_proposes_what_followed_the_latest_match():
    proposer = NgramProposer(min_n=1, max_n=3)
    tokens = [5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7]
    assert proposer.find(tokens, 3) == ([9, 2, 5], 3)  # latest earlier "5 6 7" is followed by 9 2 5
    assert proposer.find([1, 2, 3, 4], 3) == ([], 0)  # nothing repeats
    assert proposer.find([4, 1, 2, 4], 5) == ([1, 2, 4], 1)  # a 1-gram, cut at the end of the context
    assert NgramProposer(min_n=2, max_n=3).find([4, 1, 2, 4], 5) == ([], 0)
    out = proposer.propose([DraftInput("a", tokens, SamplingParams(), None, 2, []),
                            DraftInput("b", [4, 1, 2, 4], SamplingParams(), None, 1, [])])
    assert {rid: p.token_ids for rid, p in out.items()} == {"a": [9, 2], "b": [1]}
    assert all(p.draft_probs is None for p in out.values())


def test_suffix_continues_the_longest_match_the_way_most_matches_continue():
    proposer = SuffixProposer(max_depth=8, max_cached_requests=2, max_spec_factor=4.0, min_token_prob=0.1)
    # "1 2 3" is matched twice in full, "9 1 2 3" once, after which 7 8 followed.
    assert proposer.find([9, 1, 2, 3, 7, 8, 5, 1, 2, 3, 4, 6, 9, 1, 2, 3], 3) == ([7, 8, 5], 4)
    # Three matches of "5 6": 7 follows two of them, the latest one 8 (frequency first); of the
    # two after "5 6 7", the latest (ties go to recency).
    assert proposer.find([5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 8, 3, 5, 6], 2) == ([7, 2], 2)
    assert proposer.find([1, 2, 3], 4) == ([], 0)
    assert SuffixProposer(8, 2, 1.0, 0.1).find([4, 1, 2, 4], 5) == ([1], 1)  # at most 1.0 x the match
    strict = SuffixProposer(8, 2, 4.0, min_token_prob=0.6)  # 7 follows only half of the matches
    assert strict.find([5, 6, 7, 1, 5, 6, 8, 2, 5, 6], 3) == ([], 2)


def test_suffix_matches_earlier_outputs_within_a_bounded_cache():
    proposer = SuffixProposer(max_depth=16, max_cached_requests=2, max_spec_factor=4.0, min_token_prob=0.1)

    def finish(rid: str, prompt: list[int], output: list[int]) -> None:
        proposer.propose([DraftInput(rid, prompt + output, SamplingParams(), None, 1, [], len(prompt))])
        proposer.retain([])

    finish("a", [30, 31], [40, 41, 42, 43, 44])
    assert proposer.find([7, 40, 41], 3) == ([42, 43, 44], 2)  # "40 41" was an earlier answer
    assert proposer.find([7, 30, 31], 3) == ([], 0)  # prompts are not cached, only outputs
    finish("b", [2], [50, 51, 52])
    finish("c", [2], [60, 61, 62])
    assert list(proposer.cache_tokens()) == [50, 51, 52, -1, 60, 61, 62, -1]  # "a" evicted
    assert proposer.find([7, 40, 41], 3) == ([], 0)
    assert proposer.find([52, 60], 3) == ([61, 62], 1)  # no match spans two outputs, nor a proposal
    off = SuffixProposer(16, 0, 4.0, 0.1)
    off.propose([DraftInput("a", [1, 40, 41], SamplingParams(), None, 1, [], 1)])
    off.retain([])
    assert off.cache_tokens().size == 0


@settings(max_examples=200, deadline=None)
@given(context=st.lists(st.integers(0, 3), min_size=2, max_size=60), k=st.integers(1, 6))
def test_suffix_lookup_is_the_longest_earlier_match(context, k):
    """Against a brute force: the match length is the longest suffix of the context (up to the
    depth) that also ends earlier in it, and the first proposed token follows one of its
    occurrences, the most frequent of their continuations."""
    depth = 8
    tokens, m = SuffixProposer(depth, 0, 100.0, 0.0).find(context, k)
    n = len(context)

    def followers(length: int) -> list[int]:
        return [context[p] for p in range(length, n) if context[p - length:p] == context[n - length:]]

    longest = max((length for length in range(1, min(depth, n - 1) + 1) if followers(length)), default=0)
    assert m == longest
    if longest:
        counts = {t: followers(longest).count(t) for t in followers(longest)}
        assert tokens and counts[tokens[0]] == max(counts.values())
        assert len(tokens) <= k
    else:
        assert tokens == []


def test_policy_shrinks_k_with_the_batch_and_stops_under_load():
    policy = SpeculationPolicy(num_speculative_tokens=4, disable_by_batch_size=4)
    assert [policy.tokens_for(n, 0) for n in (1, 2, 3, 4, 5, 32)] == [4, 3, 2, 1, 0, 0]
    assert policy.tokens_for(1, num_waiting=1) == 0


def test_speculative_config_is_validated():
    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    draft = EngineConfig(speculative_config={"model": "qwen2.5-coder-0.5b"}).speculative_config
    assert draft.method == "draft_model" and draft.model == "qwen2.5-coder-0.5b"  # implied by "model", as vLLM
    skip = EngineConfig(speculative_config={"method": "layer_skip", "draft_layers": [0, 1]}).speculative_config
    assert skip.draft_layers == [0, 1]
    suffix = EngineConfig(speculative_config='{"method": "suffix", "suffix_decoding_max_tree_depth": 12}')
    assert suffix.speculative_config.suffix_decoding_max_tree_depth == 12
    assert suffix.speculative_config.suffix_decoding_max_cached_requests == 1000  # the default filled in
    assert suffix.speculative_config.adaptive and not SpeculativeConfig(adaptive=False).adaptive
    assert default_draft_layers(28) == [*range(14), 15, 17, 19, 21, 23, 25, 27] and default_draft_layers(1) == [0]
    for bad in ('{"method": "eagle"}', '{"num_speculative_tokens": 0}', "not json", '{"k": 3}',
                '{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', '{"method": "draft_model"}',
                '{"method": "ngram", "model": "x"}', '{"method": "layer_skip", "draft_layers": [2, 1]}',
                '{"method": "layer_skip", "draft_layers": []}', '{"method": "ngram", "draft_layers": [0]}',
                '{"method": "ngram", "suffix_decoding_max_tree_depth": 8}', '{"adaptive": "yes"}',
                '{"method": "suffix", "suffix_decoding_max_tree_depth": 0}',
                '{"method": "suffix", "suffix_decoding_max_cached_requests": -1}',
                '{"method": "suffix", "suffix_decoding_max_spec_factor": 0}',
                '{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}'):
        with pytest.raises(ConfigError, match="speculative-config"):
            EngineConfig(speculative_config=bad)


# ----------------------------------------------------------------------------- verification

def test_greedy_verification_keeps_the_matching_prefix_and_the_targets_next():
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 4, 7, 1]):  # the target's argmax after each position
        logits[row, best] = 5.0
    req = _req([1, 2], temperature=0.0)
    out = Sampler().speculative(logits, [req], [[3, 4, 5]])
    assert out.token_ids == [[3, 4, 7]] and out.num_accepted == [2]  # 5 rejected: the target says 7
    out = Sampler().speculative(logits, [req], [[3, 4, 7]])
    assert out.token_ids == [[3, 4, 7, 1]] and out.num_accepted == [3]  # all kept, plus a bonus token


def _first_token_counts(p: torch.Tensor, proposal_dist: torch.Tensor, fixed: bool, n: int) -> torch.Tensor:
    """Empirical distribution of the first emitted token over n seeded verifications of one proposal."""
    sampler = Sampler(seed=0)
    logits = p.log().unsqueeze(0).repeat(2, 1)  # rows: after the last token, after the proposal
    counts = torch.zeros_like(p)
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = int(torch.multinomial(proposal_dist, 1, generator=gen))
        q = None if fixed else [proposal_dist.unsqueeze(0)]
        out = sampler.speculative(logits, [_req([0], temperature=1.0)], [[x]], q)
        counts[out.token_ids[0][0]] += 1
    return counts


def _chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("fixed", [True, False], ids=["point-mass proposal", "draft distribution"])
def test_rejection_sampling_keeps_the_target_distribution(fixed):
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    q = torch.tensor([0.05, 0.1, 0.1, 0.15, 0.3, 0.3])  # a draft that likes what the target does not
    counts = _first_token_counts(p, q, fixed, 6000)
    # 5 degrees of freedom: the 0.999 quantile is 20.5. Without the correction (keeping every
    # proposal, or resampling from p instead of the residual) the statistic is in the thousands.
    assert _chi_square(counts, p) < 20.5, counts / counts.sum()


# ----------------------------------------------------------------------------- the engine

METHODS = ["ngram", "suffix", "draft_model", "layer_skip"]


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A draft with the target's tokenizer and different weights: it guesses wrong often."""
    return make_tiny_model(tmp_path_factory.mktemp("draft") / "llama", seed=1)


def _spec(method: str, loaded, other_draft, **extra) -> dict:  # noqa: F811
    on_any_batch = {"num_speculative_tokens": 4, "disable_by_batch_size": 64, "adaptive": False}  # as NGRAM
    if method == "ngram":
        return {**NGRAM, **extra}
    if method == "suffix":
        return {"method": "suffix", **on_any_batch, **extra}
    if method == "draft_model":
        return {"model": str(extra.pop("draft", other_draft)), **on_any_batch, **extra}
    return {"method": "layer_skip", **on_any_batch, **extra}


def _counting(llm) -> list[tuple[int, int]]:
    """(proposed, accepted) of every verified run the engine reports from now on."""
    steps: list[tuple[int, int]] = []
    engine = llm.engine
    original = engine.step_with_stats

    def counting():
        outs, stats = original()
        steps.extend(stats.spec_results)
        return outs, stats

    engine.step_with_stats = counting
    return steps


@pytest.mark.parametrize("method", METHODS)
def test_greedy_batch_of_32_identical(method, loaded, alone, other_draft):  # noqa: F811
    llm = make_llm(loaded, speculative_config=_spec(method, loaded, other_draft))
    steps = _counting(llm)
    assert texts(llm.generate(prompts(32), GREEDY)) == alone
    assert sum(a for _, a in steps) > 0, "no proposal was ever accepted: the test exercises nothing"
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("method", METHODS)
def test_adaptive_draft_lengths_are_lossless_one_request_at_a_time(method, loaded, alone, other_draft):  # noqa: F811
    """The default (adaptive) configuration as a single user runs it: every request alone,
    greedy tokens identical to plain decoding; each request's first run verifies one proposal
    and a longer run only follows proposals of its own that were accepted (own_run_cap)."""
    spec = {k: v for k, v in _spec(method, loaded, other_draft).items() if k not in ("adaptive", "disable_by_batch_size")}
    llm = make_llm(loaded, speculative_config=spec)
    _rows_nearly_free(llm)
    steps = _counting(llm)
    got = []
    for p in prompts(12):
        start = len(steps)
        got.append(texts(llm.generate([p], GREEDY))[0])
        runs = steps[start:]
        if runs:
            assert runs[0][0] == 1, f"a request's first run verified {runs[0][0]} proposals"
        for i, (proposed, _) in enumerate(runs):
            assert proposed <= 1 + 2 * sum(a for _, a in runs[:i]), f"run {i} of {runs} outgrew its acceptance"
    assert got == alone[:12]
    assert steps, "nothing was verified"


class _NearlyFreeRows:
    """A step's price as on a large model at one user: the weights' read, rows almost free. (The
    tiny model's steps cost 1.6x with a second row, where no proposal of a random model pays.)"""

    def predict(self, shape) -> float:
        return 0.06 + 0.001 * shape.num_tokens


def _rows_nearly_free(llm) -> None:
    llm.engine.spec_policy.adaptive.cost = _NearlyFreeRows()


class _WrongProposer:
    """Always proposes a token the target never emits."""

    writes_kv = False
    lookup = True

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, inputs):
        return {d.request_id: Proposal([self.token] * d.budget, match_len=2) for d in inputs}

    def retain(self, request_ids) -> None:
        pass


def test_rejected_proposals_stop_costing_rows_within_a_few_steps(loaded):  # noqa: F811
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    plain = [texts(make_llm(loaded).generate([p], params))[0] for p in prompts(4)]
    never = next(t for t in range(3, 300) if all(t not in out for out in plain))
    llm = make_llm(loaded, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    llm.engine.proposer = _WrongProposer(never)
    _rows_nearly_free(llm)  # so that it does start speculating
    steps = _counting(llm)
    for p, expected in zip(prompts(4), plain):
        before = len(steps)
        assert texts(llm.generate([p], params))[0] == expected
        runs = steps[before:]
        assert all(accepted == 0 for _, accepted in runs)
        # A few runs while its estimate falls, then a one-proposal probe every PROBE_INTERVAL steps.
        assert len(runs) <= 4 + 64 // PROBE_INTERVAL, runs
    assert len(steps) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_under_chunking_prefix_hits_and_preemption(method, loaded, alone, other_draft):  # noqa: F811
    spec = _spec(method, loaded, other_draft)
    chunked = make_llm(loaded, speculative_config=spec, max_num_batched_tokens=7, max_num_seqs=5)
    assert texts(chunked.generate(prompts(32), GREEDY)) == alone
    cached = make_llm(loaded, speculative_config=spec)
    cached.generate(prompts(32), GREEDY)
    assert texts(cached.generate(prompts(32), GREEDY)) == alone  # every prompt now a prefix hit
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 16 * (2 if method == "draft_model" else 1)
    for mode in ("recompute", "swap"):
        small = make_llm(loaded, speculative_config=spec, kv_cache_memory=8 * bytes_per_block,
                         preemption_mode=mode, max_model_len=128)
        keep = [i for i, p in enumerate(prompts(32)) if len(p) + 24 <= 128]
        got = texts(small.generate([prompts(32)[i] for i in keep], GREEDY))
        assert got == [alone[i] for i in keep]
        assert small.engine.kv.num_free_blocks == small.engine.kv.num_blocks
        assert small.engine.scheduler.num_preemptions > 0, "the cache was meant to be too small"


@pytest.mark.parametrize("method", ["draft_model", "layer_skip"])
def test_a_draft_equal_to_the_target_is_almost_always_right(method, loaded, alone):  # noqa: F811
    """The target drafting for itself (as a draft model, or with all its layers) must be accepted
    nearly always: anything less means the drafter's K/V (catch-up, fed-back guesses, the slots
    the verification rewrites) went out of step with the tokens."""
    spec = ({"model": str(loaded.path)} if method == "draft_model" else {"method": "layer_skip", "draft_layers": [0, 1]})
    spec |= {"num_speculative_tokens": 4, "disable_by_batch_size": 64, "adaptive": False}
    llm = make_llm(loaded, speculative_config=spec, max_num_batched_tokens=16)  # chunked catch-up too
    steps = _counting(llm)
    assert texts(llm.generate(prompts(8), GREEDY)) == alone[:8]
    proposed, accepted = sum(p for p, _ in steps), sum(a for _, a in steps)
    assert proposed > 50 and accepted / proposed > 0.95, (accepted, proposed)


@pytest.mark.parametrize("method", METHODS)
def test_stop_strings_max_tokens_and_logprobs(method, loaded, other_draft):  # noqa: F811
    plain, spec = make_llm(loaded), make_llm(loaded, speculative_config=_spec(method, loaded, other_draft))
    params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True, logprobs=2)
    for p in prompts(6, seed=3):
        a, b = plain.generate([p], params)[0].outputs[0], spec.generate([p], params)[0].outputs[0]
        assert b.token_ids == a.token_ids and len(b.token_ids) == 17
        assert [x.logprob for x in b.logprobs] == pytest.approx([x.logprob for x in a.logprobs], abs=1e-4)
        assert [[t for t, _, _ in x.top] for x in b.logprobs] == [[t for t, _, _ in x.top] for x in a.logprobs]
        if len(a.text) > 6:
            stop = a.text[3:6]
            sa = plain.generate([p], SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True, stop=[stop]))
            sb = spec.generate([p], SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True, stop=[stop]))
            assert sb[0].outputs[0].text == sa[0].outputs[0].text
            assert sb[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_is_reproducible(method, loaded, other_draft):  # noqa: F811
    spec = make_llm(loaded, speculative_config=_spec(method, loaded, other_draft))
    steps = _counting(spec)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=11, n=2)
    first = [o.token_ids for o in spec.generate([prompts(1)[0]], params)[0].outputs]
    again = [o.token_ids for o in spec.generate([prompts(1)[0]], params)[0].outputs]
    assert first == again and all(len(t) == 20 for t in first)
    assert steps, "nothing was verified"


def test_sampled_drafts_keep_the_target_distribution(loaded, other_draft):  # noqa: F811
    """End to end through a draft model that disagrees with the target, at temperature 1: the
    second generated token (the first one drafts can change) follows the target's own
    distribution (chi-square). Keeping every draft, or resampling from p instead of the
    residual, gives the draft's distribution or a skewed one and fails."""
    from tessera.models.loader import forward_single

    prompt = prompts(1, seed=1)[0]
    first = int(forward_single(loaded, prompt)[-1].argmax())  # p = 0.31: condition on it
    p = forward_single(loaded, [*prompt, first])[-1].softmax(-1)
    spec = {"model": str(other_draft), "num_speculative_tokens": 3, "disable_by_batch_size": 64, "adaptive": False}
    llm = make_llm(loaded, speculative_config=spec, max_num_seqs=64)
    steps = _counting(llm)
    counts = torch.zeros_like(p)
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)  # room for one proposal
    for _ in range(30):  # batches the engine admits at once: speculation is off while requests wait
        for o in llm.generate([prompt] * 60, params):
            if o.outputs[0].token_ids[0] == first:
                counts[o.outputs[0].token_ids[1]] += 1
    proposed, accepted = sum(x for x, _ in steps), sum(a for _, a in steps)
    assert proposed > 500 and 0 < accepted < proposed, (proposed, accepted)  # both branches exercised
    n = counts.sum()
    top = p.argsort(descending=True)[:5]  # the likely tokens; the tail pooled into one bin
    obs = torch.cat([counts[top], (n - counts[top].sum()).unsqueeze(0)])
    exp = torch.cat([p[top], (1 - p[top].sum()).unsqueeze(0)]) * n
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert stat < 20.5, (obs, exp)  # 5 degrees of freedom, 0.999 quantile


def test_requests_can_opt_out(loaded, other_draft):  # noqa: F811
    llm = make_llm(loaded, speculative_config=_spec("ngram", loaded, other_draft))
    steps = _counting(llm)
    out = llm.generate(prompts(4), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculative=False))
    assert steps == [] and all(len(o.outputs[0].token_ids) == 24 for o in out)
    llm.generate(prompts(4), GREEDY)
    assert steps, "without the opt-out the same requests speculate"


def test_a_draft_with_another_tokenizer_is_refused(loaded, tmp_path):  # noqa: F811
    import json as _json
    import shutil

    other = make_tiny_model(tmp_path / "other", seed=2)
    vocab = _json.loads((other / "tokenizer.json").read_text())
    vocab["model"]["vocab"] = {k: (v + 1) % len(vocab["model"]["vocab"]) for k, v in vocab["model"]["vocab"].items()}
    (other / "tokenizer.json").write_text(_json.dumps(vocab))
    with pytest.raises(Exception, match="does not share the tokenizer"):
        make_llm(loaded, speculative_config={"model": str(other)})
    shutil.rmtree(other)


def test_server_with_a_draft_model_through_the_openai_client(loaded, other_draft):  # noqa: F811
    """The real server with draft-model speculation: streamed and whole greedy replies agree with
    each other, a request can opt out, a bad value is a 400, and the spec_decode metrics count."""
    import httpx
    import openai
    from fakes import serve_in_thread

    from tessera.config import EngineConfig
    from tessera.engine.frontend.async_engine import AsyncLLMEngine
    from tessera.engine.llm_engine import LLMEngine
    from tessera.metrics import PrometheusStatLogger
    from tessera.server.app import create_app

    spec = {"model": str(loaded.path), "num_speculative_tokens": 3}  # the target drafting for itself
    config = EngineConfig(model=str(loaded.path), dtype="float32", max_model_len=256, speculative_config=spec)
    prometheus = PrometheusStatLogger("tiny")
    engine = AsyncLLMEngine(config, engine=LLMEngine(config, loaded=loaded), stat_loggers=[prometheus])
    try:
        with serve_in_thread(create_app(engine, ["tiny"], metrics=prometheus)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            args = dict(model="tiny", prompt="hello world, hello", max_tokens=20, temperature=0.0)
            whole = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                **args, stream=True, extra_body={"ignore_eos": True}) if c.choices)
            assert whole == streamed and whole
            drafts = _settled_metric(url, "tessera:spec_decode_num_draft_tokens_total", minimum=1)
            assert drafts > 0
            opted_out = client.completions.create(**args, extra_body={"ignore_eos": True, "speculative": False})
            assert opted_out.choices[0].text == whole
            assert _settled_metric(url, "tessera:spec_decode_request_acceptance_rate_count", minimum=2) == 2
            assert _metric(httpx.get(f"{url}/metrics").text, "tessera:spec_decode_num_draft_tokens_total") == drafts
            with pytest.raises(openai.BadRequestError):
                client.completions.create(**args, extra_body={"speculative": "sometimes"})
    finally:
        engine.shutdown()


def _settled_metric(url: str, name: str, minimum: float) -> float:
    """A metric once the stats thread has recorded at least `minimum` (it runs after the step)."""
    import httpx

    deadline = time.monotonic() + 10
    while True:
        value = _metric(httpx.get(f"{url}/metrics").text, name)
        if value >= minimum or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
