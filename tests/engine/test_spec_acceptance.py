"""Adaptive draft lengths: the expected-tokens arithmetic, the choice of k against a step-cost
model, and a request's estimate converging off (and probing back on) from its verified runs."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.engine.core.cost_model import StepShape
from tessera.engine.core.spec_acceptance import (
    MARGIN, PROBE_INTERVAL, AcceptanceEstimate, AcceptanceModel, AdaptiveDraftLength, best_draft_length,
    expected_tokens, match_bucket)


class LinearCost:
    """A step costs `base` plus `per_row` a token, plus `multi` once if a chunk has several tokens."""

    def __init__(self, base: float, per_row: float, multi: float = 0.0) -> None:
        self.base, self.per_row, self.multi = base, per_row, multi

    def predict(self, shape: StepShape) -> float:
        return self.base + self.per_row * shape.num_tokens + self.multi * min(1, shape.num_multi)


def _one_decode(context: int) -> StepShape:
    return StepShape.chunk(context - 1, 1, True)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0, 0.3) == 1.0
    assert expected_tokens(3, 0.5) == 1 + 0.5 + 0.25 + 0.125
    assert expected_tokens(4, 1.0) == 5.0 and expected_tokens(4, 0.0) == 1.0


def test_match_buckets_group_lengths():
    assert [match_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 500)] == [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7]


costs = st.builds(LinearCost, st.floats(0.001, 1.0), st.floats(0.0, 0.2), st.floats(0.0, 0.2))


@settings(max_examples=300, deadline=None)
@given(cost=costs, a=st.floats(0.0, 1.0), b=st.floats(0.0, 1.0), available=st.integers(0, 16),
       context=st.integers(1, 4000), others=st.integers(0, 3))
def test_k_is_monotone_in_acceptance_and_within_the_proposal(cost, a, b, available, context, others):
    step = _one_decode(context)
    for _ in range(others):
        step = step.plus(_one_decode(100))
    low, high = sorted((a, b))
    k_low = best_draft_length(cost.predict, low, available, step, context)
    k_high = best_draft_length(cost.predict, high, available, step, context)
    assert 0 <= k_low <= k_high <= available


@settings(max_examples=300, deadline=None)
@given(cost=costs, a=st.floats(0.0, 1.0), available=st.integers(1, 16), context=st.integers(1, 4000))
def test_k_is_zero_whenever_verifying_cannot_pay(cost, a, available, context):
    """Alone in the step, no run can emit more than 1 / (1 - a) tokens; where even one extra row
    costs more than that ratio (with the margin), plain decoding wins and k is 0. Where the
    cheapest run pays, some k is taken."""
    step = _one_decode(context)
    plain = cost.predict(step)
    one_more = cost.predict(StepShape(2, 2, 0, 1))
    k = best_draft_length(cost.predict, a, available, step, context)
    bound = math.inf if a >= 1 else 1 / (1 - a)
    if bound <= (1 + MARGIN) * one_more / plain:
        assert k == 0
    if expected_tokens(1, a) > (1 + MARGIN) * 1.0001 * one_more / plain:
        assert k >= 1


def test_free_rows_and_certain_acceptance_take_the_whole_proposal():
    step = _one_decode(50)
    assert best_draft_length(LinearCost(0.05, 0.0).predict, 0.99, 7, step, 50) == 7
    assert best_draft_length(LinearCost(0.05, 0.0).predict, 0.0, 7, step, 50) == 0  # nothing accepted: nothing gained
    # Each row adds a sixth of a one-row step: a = 0.1 pays for no run, a = 0.9 for all four.
    costly = LinearCost(0.1, 0.02)
    assert best_draft_length(costly.predict, 0.1, 4, StepShape(1, 1, 50, 0), 50) == 0
    assert best_draft_length(costly.predict, 0.9, 4, StepShape(1, 1, 50, 0), 50) == 4


def _run(chooser: AdaptiveDraftLength, est: AcceptanceEstimate, match_len: int, accepted_fraction: float,
         steps: int) -> list[int]:
    """The draft lengths of `steps` steps of a request always offered 8 proposals of `match_len`,
    accepting that fraction of each run (rounded down), bookkept as the scheduler does."""
    ks = []
    for _ in range(steps):
        k = chooser.choose(est, match_len, 8, _one_decode(200), 200)
        ks.append(k)
        if k == 0:
            est.off_steps += 1
        else:
            est.off_steps, est.match_len = 0, match_len
            chooser.model.observe(est, k, int(k * accepted_fraction))
    return ks


def test_rejected_proposals_turn_speculation_off_within_a_few_steps_and_probe_rarely():
    chooser = AdaptiveDraftLength(LinearCost(0.06, 0.01, 0.005))
    est = AcceptanceEstimate()
    ks = _run(chooser, est, match_len=2, accepted_fraction=0.0, steps=80)
    first_off = ks.index(0)
    assert first_off <= 4, ks
    verified_later = [k for k in ks[first_off:] if k]
    assert verified_later and all(k == 1 for k in verified_later), ks  # probes only, of one proposal
    assert len(verified_later) <= (80 - first_off) // PROBE_INTERVAL + 1, ks


def test_a_request_that_starts_copying_turns_speculation_back_on():
    chooser = AdaptiveDraftLength(LinearCost(0.06, 0.01, 0.005))
    est = AcceptanceEstimate()
    _run(chooser, est, match_len=2, accepted_fraction=0.0, steps=30)
    ks = _run(chooser, est, match_len=2, accepted_fraction=1.0, steps=2 * PROBE_INTERVAL + 4)
    assert ks[-1] >= 4, ks


def test_accepted_proposals_keep_speculation_on_and_long_matches_count_for_more():
    chooser = AdaptiveDraftLength(LinearCost(0.06, 0.01, 0.005))
    ks = _run(chooser, AcceptanceEstimate(), match_len=8, accepted_fraction=1.0, steps=20)
    assert min(ks) >= 1 and ks[-1] == 8, ks
    model = AcceptanceModel()
    for _ in range(200):  # long matches accepted, one-token matches rejected, across requests
        model.observe(AcceptanceEstimate(match_len=16), 4, 4)
        model.observe(AcceptanceEstimate(match_len=1), 4, 0)
    fresh = AcceptanceEstimate()
    assert model.acceptance(fresh, 16) > 0.9 > 0.1 > model.acceptance(fresh, 1)
    doubtful = AcceptanceEstimate(accepted=0.0, rejected=3.0)  # this request's last runs failed
    assert model.acceptance(doubtful, 1) < model.acceptance(doubtful, 16)


def test_the_overhead_of_verified_runs_is_measured_not_taken_from_prompt_chunks():
    """The cost model's multi-token term (fitted on prompt chunks) is left out of a run's price
    until steps with runs show what they cost beyond their rows."""
    cost = LinearCost(0.06, 0.001, multi=0.2)  # prompt chunks pay 0.2 s more than their rows
    chooser = AdaptiveDraftLength(cost)
    run = StepShape(5, 5, 250, 1)
    assert chooser.price(run) == cost.predict(StepShape(5, 5, 250, 0))
    assert chooser.choose(AcceptanceEstimate(), 8, 4, _one_decode(50), 50) > 0
    for _ in range(30):  # here runs do pay it: the one-token steps run as one call, runs do not
        chooser.observe_step(run, cost.predict(run))
    assert abs(chooser.price(run) - cost.predict(run)) < 0.01
    assert chooser.choose(AcceptanceEstimate(), 8, 4, _one_decode(50), 50) == 0
    chooser.observe_step(StepShape(40, 1, 900, 1), 5.0)  # a prompt chunk: not a run's price
    assert abs(chooser.price(run) - cost.predict(run)) < 0.01


def test_a_new_request_verifies_one_proposal_however_confident_the_table_is():
    """Other requests' acceptance is tried cheaply before it is trusted: one proposal until the
    request's own are accepted, then runs that grow with them."""
    chooser = AdaptiveDraftLength(LinearCost(0.05, 0.0))  # free rows: only the cap limits k
    for _ in range(200):
        chooser.model.observe(AcceptanceEstimate(match_len=16), 8, 8)
    assert chooser.choose(AcceptanceEstimate(), 16, 8, _one_decode(200), 200) == 1
    ks = _run(chooser, AcceptanceEstimate(), match_len=16, accepted_fraction=1.0, steps=4)
    assert ks[0] == 1 and ks[1] == 3 and ks[-1] == 8, ks
    rejected = _run(chooser, AcceptanceEstimate(), match_len=16, accepted_fraction=0.0, steps=6)
    assert max(rejected) == 1, rejected
