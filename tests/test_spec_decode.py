"""Speculative decoding: proposals, the load policy, lossless verification, engine invariance."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tessera.config import EngineConfig, SpeculativeConfig
from tessera.engine.sampler import Sampler
from tessera.engine.spec_decode import NgramProposer, SpeculationPolicy
from tessera.errors import ConfigError
from tessera.sampling_params import SamplingParams

from test_engine import GREEDY, alone, loaded, make_llm, prompts, texts  # noqa: F401 (fixtures)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}  # on at any batch here: the invariance tests want it working


def _req(tokens: list[int], generator=None, **params):
    return SimpleNamespace(all_token_ids=tokens, params=SamplingParams(**params), generator=generator,
                           output_token_ids=[])


# ----------------------------------------------------------------------------- proposals and policy

def test_ngram_proposes_what_followed_the_latest_match():
    proposer = NgramProposer(min_n=1, max_n=3)
    tokens = [5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7]
    assert proposer.propose(_req(tokens), 3) == [9, 2, 5]  # latest earlier "5 6 7" is followed by 9 2 5
    assert proposer.propose(_req([1, 2, 3, 4]), 3) == []  # nothing repeats
    assert proposer.propose(_req([4, 1, 2, 4]), 5) == [1, 2, 4]  # a 1-gram, cut at the end of the context
    assert NgramProposer(min_n=2, max_n=3).propose(_req([4, 1, 2, 4]), 5) == []


def test_policy_shrinks_k_with_the_batch_and_stops_under_load():
    policy = SpeculationPolicy(num_speculative_tokens=4, disable_by_batch_size=4)
    assert [policy.tokens_for(n, 0) for n in (1, 2, 3, 4, 5, 32)] == [4, 3, 2, 1, 0, 0]
    assert policy.tokens_for(1, num_waiting=1) == 0


def test_speculative_config_is_validated():
    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    for bad in ('{"method": "eagle"}', '{"num_speculative_tokens": 0}', "not json", '{"k": 3}',
                '{"prompt_lookup_min": 5, "prompt_lookup_max": 2}'):
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

def _spec_llm(loaded, **opts):
    return make_llm(loaded, speculative_config=NGRAM, **opts)


def test_greedy_batch_of_32_identical_with_ngram(loaded, alone):  # noqa: F811
    llm = _spec_llm(loaded)
    steps = []
    engine = llm.engine
    original = engine.step_with_stats

    def counting():
        outs, stats = original()
        steps.extend(stats.spec_results)
        return outs, stats

    engine.step_with_stats = counting
    assert texts(llm.generate(prompts(32), GREEDY)) == alone
    assert sum(a for _, a in steps) > 0, "no proposal was ever accepted: the test exercises nothing"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_greedy_identical_with_ngram_under_chunking_prefix_hits_and_preemption(loaded, alone):  # noqa: F811
    chunked = _spec_llm(loaded, max_num_batched_tokens=7, max_num_seqs=5)
    assert texts(chunked.generate(prompts(32), GREEDY)) == alone
    cached = _spec_llm(loaded)
    cached.generate(prompts(32), GREEDY)
    assert texts(cached.generate(prompts(32), GREEDY)) == alone  # every prompt now a prefix hit
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 16
    for mode in ("recompute", "swap"):
        small = _spec_llm(loaded, kv_cache_memory=8 * bytes_per_block, preemption_mode=mode, max_model_len=128)
        keep = [i for i, p in enumerate(prompts(32)) if len(p) + 24 <= 128]
        got = texts(small.generate([prompts(32)[i] for i in keep], GREEDY))
        assert got == [alone[i] for i in keep]
        assert small.engine.kv.num_free_blocks == small.engine.kv.num_blocks


def test_stop_strings_max_tokens_and_logprobs_with_ngram(loaded):  # noqa: F811
    plain, spec = make_llm(loaded), _spec_llm(loaded)
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


def test_seeded_sampling_with_ngram_is_reproducible(loaded):  # noqa: F811
    spec = _spec_llm(loaded)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=11, n=2)
    first = [o.token_ids for o in spec.generate([prompts(1)[0]], params)[0].outputs]
    again = [o.token_ids for o in spec.generate([prompts(1)[0]], params)[0].outputs]
    assert first == again and all(len(t) == 20 for t in first)
