"""How often a request's proposals are accepted, and how many it pays to verify this step.

Verifying k proposals makes the request's row of the step 1 + k query rows. On a CPU at small
batch the extra rows are cheap but not free (a 1.5B model's one-row step reads the weights, a
five-row one runs the modules and is partly compute-bound), so a run pays only when the tokens it
is expected to emit outrun its extra cost. Both are plain numbers before the step:

- the expected tokens of a run of k, 1 + a + ... + a^k, from `a`, the probability that a
  proposal is accepted given the ones before it were: an online estimate per request (its own
  recent runs, decayed) combined with how often proposals of the same match length were accepted
  across all requests (a lookup that matched 16 tokens is right far more often than one that
  matched 1);
- the step's price with those rows: the step-cost model's (`cost_model.py`) for the rows as
  one-token rows, plus what a step with verified runs has been measured to cost beyond that
  (`AdaptiveDraftLength.run_overhead_s`). The model's own term for a step with a multi-token chunk
  is fitted on prompt chunks, which take the prefill path; a verified run takes the decode
  kernels, and pays that term only where one-token steps run as one C call and a run does not.
  The overhead starts at none, so speculation is tried, and the first verified steps measure it.

A request's run is also capped by its own accepted proposals (`own_run_cap`: one proposal at
first), so what other requests taught the table is tried cheaply before it is trusted.

Each step takes, per request, the k that maximises expected tokens per second of the step; k = 0
(plain decoding: no extra rows, no cost) unless some k beats it by a margin, so a request whose
proposals keep being rejected stops paying for them within a few steps. With no evidence coming in
while a request is off, it re-probes with one proposal after `PROBE_INTERVAL` steps that had one,
so a request that starts copying later turns speculation back on; a long match raises the
estimate on its own and needs no probe.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from tessera.engine.core.cost_model import StepCostPredictor, StepShape

# Pseudo-runs of the match-length prior inside one request's estimate: its own first runs soon
# outweigh it, but one unlucky run does not switch it off.
PRIOR_WEIGHT = 2.0
# Weight left to a request's earlier evidence after each of its verified runs: its last ~3 runs
# decide, so a request whose output stops (or starts) copying its input is followed within a few steps.
REQUEST_DECAY = 0.7
# The same for the match-length table over all requests: it learns the model and the traffic.
GLOBAL_DECAY = 0.995
# A k > 0 must promise this much more throughput than plain decoding: the cost model's error
# and the estimate's noise must not turn a break-even into a loss.
MARGIN = 0.05
# Steps with a proposal but no verification after which one proposal is verified anyway.
PROBE_INTERVAL = 16
# Weight of one measured step in the overhead of steps with verified runs.
RUN_OVERHEAD_ALPHA = 0.2
# Match lengths grouped for the table: exact up to 3, then by powers of two; 0 = not a lookup.
_MATCH_BUCKET_LIMITS = (0, 1, 2, 3, 4, 8, 16, 32)
# The table's starting belief (accepted, rejected pseudo-counts), longer matches more often right.
_INITIAL_PRIOR = ((1.0, 1.0), (0.6, 1.4), (0.8, 1.2), (1.0, 1.0), (1.2, 0.8), (1.4, 0.6), (1.5, 0.5),
                  (1.6, 0.4))
_CLAMP = 1e-4


def expected_tokens(k: int, a: float) -> float:
    """Tokens a verified run of k proposals emits: its accepted prefix plus the target's own next
    token, 1 + a + ... + a^k, when each proposal is accepted with probability a once the ones
    before it were."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def match_bucket(match_len: int) -> int:
    """The table row of a proposal found by a match of `match_len` tokens (0: not a lookup)."""
    bucket = 0
    for i, low in enumerate(_MATCH_BUCKET_LIMITS):
        if match_len >= low:
            bucket = i
    return bucket


def _logit(p: float) -> float:
    p = min(max(p, _CLAMP), 1.0 - _CLAMP)
    return math.log(p / (1.0 - p))


@dataclass
class AcceptanceEstimate:
    """One request's speculation record, kept on its `Request` and written by the scheduler.

    A run of k proposals with m accepted is m accepted proposals and, when m < k, one rejection
    (what follows a rejection is never verified); both counts decay by `REQUEST_DECAY` per run."""

    accepted: float = 0.0
    rejected: float = 0.0
    off_steps: int = 0  # steps in a row whose proposal was withheld (verifying it would not pay)
    match_len: int = 0  # of the proposal being verified this step


@dataclass
class AcceptanceModel:
    """Acceptance across all requests by match length (decayed counts), and the per-request
    estimate that combines a request's own evidence with it: additive on the log-odds scale,
    the request's own rate (its runs over the overall rate as prior) shifted by how much better
    or worse than overall its proposal's match length does."""

    table: list[list[float]] = field(default_factory=lambda: [list(p) for p in _INITIAL_PRIOR])

    def overall(self) -> float:
        accepted = sum(a for a, _ in self.table)
        return accepted / (accepted + sum(r for _, r in self.table))

    def acceptance(self, est: AcceptanceEstimate, match_len: int) -> float:
        """The probability that each proposal of this request's next run is accepted."""
        overall = self.overall()
        own = (est.accepted + PRIOR_WEIGHT * overall) / (est.accepted + est.rejected + PRIOR_WEIGHT)
        a, r = self.table[match_bucket(match_len)]
        shift = _logit(a / (a + r)) - _logit(overall) if match_len > 0 else 0.0
        return 1.0 / (1.0 + math.exp(-(_logit(own) + shift)))

    def observe(self, est: AcceptanceEstimate, proposed: int, accepted: int) -> None:
        """Fold one verified run into the request's estimate and the match-length table."""
        if proposed <= 0:
            return
        rejected = 1.0 if accepted < proposed else 0.0
        est.accepted = REQUEST_DECAY * est.accepted + accepted
        est.rejected = REQUEST_DECAY * est.rejected + rejected
        row = self.table[match_bucket(est.match_len)]
        row[0] = GLOBAL_DECAY * row[0] + accepted
        row[1] = GLOBAL_DECAY * row[1] + rejected


def own_run_cap(est: AcceptanceEstimate) -> int:
    """The longest run this request may verify: one proposal until its own proposals have been
    accepted, then growing with them (1 + twice its decayed accepted count: 3, then 8 after
    runs that were accepted whole). The table of other requests' acceptance can be confident
    about a request it has never seen: on qwen2.5-coder-1.5b, after code edits had taught it
    that matches are right, a translation verified two long runs, both rejected, and ran at
    0.964x its time without speculation; one-proposal runs cost almost nothing to lose."""
    return 1 + int(2 * est.accepted)


def best_draft_length(price: Callable[[StepShape], float], a: float, available: int, step: StepShape,
                      context: int) -> int:
    """The k in [0, available] that maximises the step's expected tokens per predicted second
    (`price`), where `step` holds one plain decode row per decoding request (this one's at
    `context` tokens) and this request's k proposals add k rows; 0 unless some k beats plain
    decoding by `MARGIN`. The others' rows count one token each, so a crowded step needs a larger
    gain per row."""
    rows = step.num_sampled
    own = StepShape.chunk(context - 1, 1, True)
    plain = price(step)
    if available <= 0 or rows <= 0 or plain <= 0:
        return 0
    best_k, best_rate = 0, rows / plain * (1.0 + MARGIN)
    for k in range(1, available + 1):
        run = StepShape.chunk(context - 1, 1 + k, True)
        shape = StepShape(step.num_tokens + k, step.num_sampled + k,
                          step.num_attended + run.num_attended - own.num_attended, step.num_multi + 1)
        rate = (rows - 1 + expected_tokens(k, a)) / price(shape)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


@dataclass
class AdaptiveDraftLength:
    """Chooses each request's draft length for the coming step (0 = withhold its proposal)."""

    cost: StepCostPredictor
    model: AcceptanceModel = field(default_factory=AcceptanceModel)
    # Seconds a step with verified runs (and no prompt chunk) took beyond the cost model's price
    # of its rows as one-token rows, exponentially weighted over such steps.
    run_overhead_s: float = 0.0

    def price(self, shape: StepShape) -> float:
        """Predicted seconds of a step of one-token rows and verified runs."""
        if shape.num_multi == 0:
            return self.cost.predict(shape)
        return self.cost.predict(replace(shape, num_multi=0)) + max(0.0, self.run_overhead_s)

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """Learn the overhead from an executed step, if it verified runs and computed no prompt
        (every row sampled: a prompt chunk samples only its last)."""
        if shape.num_multi > 0 and shape.num_sampled == shape.num_tokens:
            extra = seconds - self.cost.predict(replace(shape, num_multi=0))
            self.run_overhead_s += RUN_OVERHEAD_ALPHA * (extra - self.run_overhead_s)

    def choose(self, est: AcceptanceEstimate, match_len: int, available: int, step: StepShape, context: int) -> int:
        available = min(available, own_run_cap(est))
        k = best_draft_length(self.price, self.model.acceptance(est, match_len), available, step, context)
        if k == 0 and available > 0 and est.off_steps >= PROBE_INTERVAL:
            return 1
        return k
