"""The sampler draws from the distribution it is given, per row, whatever the batch."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from tessera.engine.worker.sampler import Sampler
from tessera.sampling_params import SamplingParams


def _req(generator=None, **params):
    return SimpleNamespace(params=SamplingParams(**params), generator=generator, output_token_ids=[],
                           all_token_ids=[1, 2, 3])


def test_draws_follow_the_softmax():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0, 0.125])
    logits = probs.clamp_min(1e-30).log().unsqueeze(0).repeat(4000, 1)
    reqs = [_req(temperature=1.0) for _ in range(4000)]
    tokens = torch.tensor(Sampler(seed=1)(logits, reqs).token_ids)
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    assert freq[3] == 0  # a zero-probability token is never drawn
    assert (freq - probs).abs().max() < 0.03  # ~4 standard errors at n = 4000


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(1, 50)
    def draw(extra_rows: int) -> int:
        reqs = [_req(torch.Generator().manual_seed(7), temperature=1.0)] + [_req(temperature=1.0)] * extra_rows
        batch = torch.cat([logits, torch.randn(extra_rows, 50)])
        return Sampler(seed=extra_rows)(batch, reqs).token_ids[0]
    assert draw(0) == draw(5) == draw(31)


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = torch.randn(3, 40)
    reqs = [_req(temperature=0.0), _req(temperature=1.0), _req(temperature=0.0)]
    out = Sampler()(logits.clone(), reqs).token_ids
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())


def test_logit_bias_is_added_before_sampling():
    logits = torch.zeros(3, 8)
    logits[:, 2] = 5.0
    reqs = [_req(temperature=0.0, logit_bias={6: 100}), _req(temperature=0.0, logit_bias={2: -100}),
            _req(temperature=0.0)]
    out = Sampler(0)(logits.clone(), reqs)
    assert out.token_ids[0] == 6 and out.token_ids[1] != 2 and out.token_ids[2] == 2
    banned = [Sampler(s)(logits.clone(), [_req(temperature=1.0, logit_bias={2: -100})]).token_ids[0]
              for s in range(20)]
    assert 2 not in banned


def test_logit_bias_values_and_keys_are_checked():
    import pytest

    from tessera.sampling_params import InvalidRequestError

    for bad in ({1: 101}, {-1: 1}, {1: float("nan")}, {i: 1 for i in range(2000)}):
        with pytest.raises(InvalidRequestError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
