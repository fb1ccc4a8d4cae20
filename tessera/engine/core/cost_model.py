"""How long an engine step takes, as a function of what it carries.

The scheduler needs to know, before running a step, what it will cost: a
prefill chunk next to running decodes stalls every stream for the whole step,
and the right chunk size depends on the model, the machine and how many rows
are decoding. A fixed token budget cannot know that; a measured model can.

The model: step time = g(tokens) + a * sampled rows + b * attended pairs + c * [multi-token
chunk], where
- g is piecewise linear over token-count knots (the layers' matmuls: nearly flat
  while memory-bound, then linear once compute-bound, with oneDNN's small-M
  inefficiency in between, which no single slope captures);
- sampled rows pay the LM head and the sampler;
- attended pairs (query token x context token, summed) pay attention;
- c is paid once by a step that carries a chunk of more than one token (a prompt chunk or a
  verified run of proposals): a step of one-token rows only may run as one C call
  (models/fused_decode.py) while any other runs the modules, so the first prompt token next to
  decodes costs far more than the next ones (SmolLM2, 32 rows: ~60 ms decode-only against
  ~110 ms with a 64-token chunk). Where decode steps run the modules too, the fit puts c near 0.
A mixture-of-experts model reads each expert its tokens chose once per step, so g grows steeply
while more tokens bring new experts and flattens once every expert runs: E (1 - (1 - k/E)^n)
distinct experts are expected for n tokens choosing k of E. The synthetic steps' tokens are
varied, so they spread over the experts as traffic does and the knots measure this; past the
largest measured step (a large model's calibration stops early) g is extended by a fit of
a + b n + c E (1 - (1 - k/E)^n) to the measured knots rather than by the last slope, which for
MoE would still carry the new experts' reads and overstate large prompt chunks many times (and
a chunk never scheduled is never observed to correct it).
It is fitted by least squares on synthetic steps measured at start-up (cost_calibration.py), then
refined online: every real step's time updates a correction factor for its
token-count bucket (an exponentially weighted mean of observed / predicted),
so load from elsewhere on the machine, or shapes the calibration extrapolated,
are learned within a few steps.

A calibration is checked before it is trusted or stored (`calibrate_checked`): a step of no more
work in any term must not cost more (samples that disagree are measured again, their median
kept); every knot must lie between half the bandwidth floor and a multiple of the roofline the
host's measured bandwidth and FLOP/s predict; and other processes must not have taken CPU during
it (beside a compiler a 1,024-token step of SmolLM2 measured 18 s, and a stored calibration is
reused by every later start). A calibration that fails is measured again
after a pause; one that still fails serves this run only, untrusted: its first observed step in
a bucket replaces the correction outright and unobserved buckets borrow the nearest observed
one, so it is corrected within a few steps, and it is never stored. A stored calibration that
the online corrections show wrong (`StepCostModel.drift`) is deleted, so the next start
measures again.
"""
from __future__ import annotations

import bisect
import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch

logger = logging.getLogger("tessera")

CORRECTION_ALPHA = 0.05  # weight of one observed step in its bucket's correction factor
CORRECTION_CLAMP = (0.25, 4.0)  # an observation further off than this (a GC pause, a swap) is clipped
# An untrusted calibration may be far off (a busy host made steps 40x slower): wider, so it is corrected.
UNTRUSTED_CLAMP = (0.01, 4.0)
CALIBRATION_FORMAT = 2  # stored files of another format (unchecked ones) are measured again
DRIFT_WINDOW = 32  # recent observed/predicted ratios kept per bucket
DRIFT_MIN_STEPS = 32  # a bucket judged only once it has this many
# A median ratio outside these says the stored calibration is wrong. Wide: a served step is timed
# with its scheduling and output processing, which calibration's steps leave out, and that alone
# put SmolLM2's one-token steps at ~1.5x.
DRIFT_BOUNDS = (0.5, 2.0)


@dataclass(frozen=True)
class StepShape:
    """The work of one step in plain numbers: what the cost model predicts from."""

    num_tokens: int = 0  # tokens through the layers (prefill chunks + decode rows)
    num_sampled: int = 0  # rows through the LM head and sampler
    num_attended: int = 0  # sum over query tokens of the context length each attends to
    num_multi: int = 0  # chunks of more than one token (prompt chunks, verified runs)

    def plus(self, other: "StepShape") -> "StepShape":
        return StepShape(self.num_tokens + other.num_tokens, self.num_sampled + other.num_sampled,
                         self.num_attended + other.num_attended, self.num_multi + other.num_multi)

    @staticmethod
    def chunk(start: int, n: int, samples: bool) -> "StepShape":
        """`n` tokens computed from position `start` (a decode is n=1 at start=context-1)."""
        return StepShape(n, 1 if samples else 0, n * start + n * (n + 1) // 2, 1 if n > 1 else 0)


class StepCostPredictor(Protocol):
    """What the scheduler asks of a cost model (a fake one in tests)."""

    def predict(self, shape: StepShape) -> float:
        """Predicted seconds for a step of this shape."""
        ...


def max_fitting(model: StepCostPredictor, base: StepShape, limit_s: float, upper: int,
                extra: Callable[[int], StepShape]) -> int:
    """Largest k in [0, upper] with predict(base + extra(k)) <= limit_s; predictions grow with k,
    so a binary search is exact."""
    if upper <= 0 or model.predict(base.plus(extra(1))) > limit_s:
        return 0
    lo, hi = 1, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if model.predict(base.plus(extra(mid))) <= limit_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class CalibrationPoint:
    shape: StepShape
    seconds: float


@dataclass(frozen=True)
class CalibrationVerdict:
    """What the checks of one calibration found: stored only when `problems` is empty."""

    other_cores: Optional[float] = None  # CPU other processes took during it, in cores (None: not measured)
    attempts: int = 1
    problems: tuple[str, ...] = ()

    @property
    def trusted(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"other_cores": self.other_cores, "attempts": self.attempts, "problems": list(self.problems)}

    @classmethod
    def from_dict(cls, d: dict) -> "CalibrationVerdict":
        other = d["other_cores"]
        return cls(None if other is None else float(other), int(d["attempts"]), tuple(str(x) for x in d["problems"]))


class StepCostModel:
    """Piecewise-linear step-cost model with online per-bucket correction."""

    def __init__(self, knots: Sequence[int], knot_seconds: Sequence[float], per_sampled: float,
                 per_attended: float, calibration: Sequence[CalibrationPoint] = (),
                 calibration_seconds: float = 0.0, per_multi_step: float = 0.0,
                 verdict: CalibrationVerdict = CalibrationVerdict()) -> None:
        if len(knots) < 2 or list(knots) != sorted(set(knots)) or knots[0] < 0:
            raise ValueError("knots must be at least two increasing token counts")
        self.knots = list(knots)
        self.knot_seconds = list(knot_seconds)
        self.per_sampled = max(0.0, per_sampled)
        self.per_attended = max(0.0, per_attended)
        self.per_multi_step = max(0.0, per_multi_step)
        self.calibration = list(calibration)
        self.calibration_seconds = calibration_seconds
        self.verdict = verdict
        self.corrections = [1.0] * len(self.knots)
        self.bucket_steps = [0] * len(self.knots)
        self._ratios = [deque(maxlen=DRIFT_WINDOW) for _ in self.knots]  # observed / predicted, recent steps
        self.observations = 0
        self._abs_rel_error = 0.0  # exponentially weighted, of the corrected prediction

    # -- prediction -------------------------------------------------------------
    def _tokens_time(self, tokens: int) -> float:
        k, s = self.knots, self.knot_seconds
        if tokens <= k[0]:
            return s[0]
        i = bisect.bisect_right(k, tokens) - 1
        if i >= len(k) - 1:  # beyond the last knot: extend the last segment's slope
            i = len(k) - 2
        slope = (s[i + 1] - s[i]) / (k[i + 1] - k[i])
        return s[i] + slope * (tokens - k[i])

    def _bucket(self, tokens: int) -> int:
        """Index of the knot nearest `tokens` on a log scale."""
        if tokens <= 0:
            return 0
        lt = math.log(tokens)
        return min(range(len(self.knots)), key=lambda i: abs(math.log(max(self.knots[i], 1)) - lt))

    def predict_raw(self, shape: StepShape) -> float:
        return (self._tokens_time(shape.num_tokens) + self.per_sampled * shape.num_sampled
                + self.per_attended * shape.num_attended + self.per_multi_step * min(1, shape.num_multi))

    def predict(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        return self.predict_raw(shape) * self._correction(self._bucket(shape.num_tokens))

    def _correction(self, bucket: int) -> float:
        """The bucket's correction factor; an untrusted calibration's unobserved bucket takes the
        nearest observed one's, since what made its steps wrong (a busy host) made them all wrong
        and a bucket the scheduler avoids because it is overpredicted would never be corrected."""
        if self.verdict.trusted or self.bucket_steps[bucket]:
            return self.corrections[bucket]
        seen = [i for i, n in enumerate(self.bucket_steps) if n]
        if not seen:
            return 1.0
        return self.corrections[min(seen, key=lambda i: abs(i - bucket))]

    # -- online refinement --------------------------------------------------------
    def observe(self, shape: StepShape, seconds: float) -> None:
        """Fold one executed step's measured time into its bucket's correction factor."""
        if shape.num_tokens == 0 or seconds <= 0:
            return
        raw = self.predict_raw(shape)
        if raw <= 0:
            return
        b = self._bucket(shape.num_tokens)
        predicted = raw * self._correction(b)
        self._ratios[b].append(seconds / raw)
        if self.verdict.trusted:
            ratio = min(max(seconds / raw, CORRECTION_CLAMP[0]), CORRECTION_CLAMP[1])
            alpha = CORRECTION_ALPHA
        else:  # a running mean from the first step: the calibration is not believed
            ratio = min(max(seconds / raw, UNTRUSTED_CLAMP[0]), UNTRUSTED_CLAMP[1])
            alpha = max(CORRECTION_ALPHA, 1.0 / (self.bucket_steps[b] + 1))
        self.corrections[b] += alpha * (ratio - self.corrections[b])
        self.bucket_steps[b] += 1
        err = abs(predicted - seconds) / seconds
        self._abs_rel_error = err if self.observations == 0 else \
            self._abs_rel_error + CORRECTION_ALPHA * (min(err, 10.0) - self._abs_rel_error)
        self.observations += 1

    def raise_to(self, roofline: Roofline) -> None:
        """Lift every knot to at least the roofline's floor: knots past the measured steps follow the
        last measured slope, which from the memory-bound steps a calibration reaches in its budget is
        nearly flat (a 1,024-token step of a 135M model extrapolated to 69 ms where its products
        alone take over a second at the host's FLOP rate)."""
        for i, k in enumerate(self.knots):
            self.knot_seconds[i] = max(self.knot_seconds[i], roofline.floor(k), self.knot_seconds[i - 1] if i else 0.0)

    def drift(self) -> Optional[str]:
        """Why the calibration itself is wrong, or None: in some bucket the median of the last
        steps' observed / uncorrected predicted time lies outside DRIFT_BOUNDS over at least DRIFT_MIN_STEPS
        steps. The corrections already absorb it in this run; the stored file must not carry it
        into the next."""
        for knot, ratios in zip(self.knots, self._ratios):
            if len(ratios) >= DRIFT_MIN_STEPS:
                median = statistics.median(ratios)
                if not DRIFT_BOUNDS[0] <= median <= DRIFT_BOUNDS[1]:
                    return (f"steps near {knot} tokens took {median:.2f}x the prediction "
                            f"(median of the last {len(ratios)})")
        return None

    # -- reporting ---------------------------------------------------------------------
    def describe(self) -> dict:
        """A JSON-able view for /v1/engine/stats and the start-up log."""
        return {
            "form": "g(tokens) + per_sampled_row * sampled + per_attended_pair * attended"
                    " + multi_token_step (once, if a chunk has several tokens), x online correction",
            "tokens_ms": {str(k): round(s * 1000, 3) for k, s in zip(self.knots, self.knot_seconds)},
            "per_sampled_row_ms": round(self.per_sampled * 1000, 4),
            "per_1k_attended_pairs_ms": round(self.per_attended * 1e6, 4),
            "multi_token_step_ms": round(self.per_multi_step * 1000, 3),
            "corrections": {str(k): round(c, 3) for k, c in zip(self.knots, self.corrections)},
            "observed_steps": self.observations,
            "mean_abs_rel_error": round(self._abs_rel_error, 4) if self.observations else None,
            "calibration_points": len(self.calibration),
            "calibration_s": round(self.calibration_seconds, 3),
            "calibration_trusted": self.verdict.trusted,
            "calibration_checks": self.verdict.to_dict(),
        }

    def summary(self) -> str:
        k = self.knots
        picks = sorted({k[0], k[min(len(k) - 1, 3)], k[-1]})
        parts = ", ".join(f"{n} tok {self._tokens_time(n) * 1000:.1f} ms" for n in picks)
        return (f"{parts}; +{self.per_sampled * 1000:.3f} ms per sampled row, "
                f"+{self.per_attended * 1e6:.3f} ms per 1k attended pairs, "
                f"+{self.per_multi_step * 1000:.1f} ms a step with a multi-token chunk "
                f"(fitted on {len(self.calibration)} steps in {self.calibration_seconds:.1f} s)")

    # -- persistence ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"knots": self.knots, "knot_seconds": self.knot_seconds, "per_sampled": self.per_sampled,
                "per_attended": self.per_attended, "per_multi_step": self.per_multi_step,
                "calibration_seconds": self.calibration_seconds,
                "calibration": [[p.shape.num_tokens, p.shape.num_sampled, p.shape.num_attended, p.shape.num_multi,
                                 p.seconds] for p in self.calibration],
                "format": CALIBRATION_FORMAT, "checks": self.verdict.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCostModel":
        points = [CalibrationPoint(StepShape(int(t), int(s), int(a), int(m)), float(sec))
                  for t, s, a, m, sec in d["calibration"]]
        return cls([int(k) for k in d["knots"]], [float(x) for x in d["knot_seconds"]], float(d["per_sampled"]),
                   float(d["per_attended"]), points, float(d["calibration_seconds"]), float(d["per_multi_step"]),
                   CalibrationVerdict.from_dict(d["checks"]))

    # -- fitting ----------------------------------------------------------------------
    @classmethod
    def fit(cls, knots: Sequence[int], points: Sequence[CalibrationPoint],
            calibration_seconds: float = 0.0, experts: Optional[tuple[int, int]] = None) -> "StepCostModel":
        """Least squares over hat functions at the knots plus the two per-unit terms.

        Knot values are then made non-decreasing (a bigger step never costs less) and
        the per-unit and per-step terms kept non-negative, so the model stays monotone in every input.
        """
        knots = list(knots)
        rows, ys = [], []
        for p in points:
            hat = [0.0] * len(knots)
            t = min(max(p.shape.num_tokens, knots[0]), knots[-1])
            i = min(bisect.bisect_right(knots, t) - 1, len(knots) - 2)
            w = (t - knots[i]) / (knots[i + 1] - knots[i])
            hat[i], hat[i + 1] = 1 - w, w
            rows.append(hat + [float(p.shape.num_sampled), p.shape.num_attended / 1000.0,
                               float(min(1, p.shape.num_multi))])
            ys.append(p.seconds)
        a = torch.tensor(rows, dtype=torch.float64)
        y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
        # A little ridge keeps knots no point touched from going wild; scaled to the data.
        lam = 1e-6 * float(a.pow(2).sum())
        sol = torch.linalg.solve(a.T @ a + lam * torch.eye(a.shape[1], dtype=torch.float64), a.T @ y)
        coef = sol.squeeze(1).tolist()
        knot_s = [max(0.0, c) for c in coef[:len(knots)]]
        for i in range(1, len(knot_s)):
            knot_s[i] = max(knot_s[i], knot_s[i - 1])
        # Knots past the largest measured step carry no data: extend the last measured slope, or
        # for a mixture of experts the measured knots' fit to its expected distinct experts.
        measured = max((p.shape.num_tokens for p in points), default=knots[-1])
        last = max(1, max((i for i, k in enumerate(knots) if k <= measured), default=1))
        slope = (knot_s[last] - knot_s[last - 1]) / (knots[last] - knots[last - 1])
        extend = None
        if experts:  # on the measured steps less what the other terms explain
            other = coef[len(knots):]
            extend = _expert_extension(
                [p.shape.num_tokens for p in points],
                [p.seconds - other[0] * p.shape.num_sampled - other[1] * p.shape.num_attended / 1000.0
                 - other[2] * min(1, p.shape.num_multi) for p in points], experts)
        for i in range(last + 1, len(knots)):
            if extend is not None:
                knot_s[i] = max(knot_s[i - 1], extend(knots[i]))
            else:
                knot_s[i] = knot_s[last] + slope * (knots[i] - knots[last])
        return cls(knots, knot_s, coef[len(knots)], coef[len(knots) + 1] / 1000.0, points, calibration_seconds,
                   coef[len(knots) + 2])


def expected_experts(tokens: int, experts: tuple[int, int]) -> float:
    """Distinct experts `tokens` tokens are expected to activate, each choosing k of E."""
    e, k = experts
    return e * (1.0 - (1.0 - k / e) ** tokens)


def _expert_extension(tokens: Sequence[int], seconds: Sequence[float],
                      experts: tuple[int, int]) -> Optional[Callable[[int], float]]:
    """a + b n + c experts(n) fitted to measured steps of n tokens with b, c >= 0 (a term fitted
    negative is dropped and the rest refitted), or None when the steps are too few to tell the
    terms apart or the experts' term does not fit (the last slope is used then)."""
    if len(set(tokens)) < 3:
        return None
    y = torch.tensor(list(seconds), dtype=torch.float64).unsqueeze(1)
    terms = [lambda n: 1.0, float, lambda n: expected_experts(n, experts)]
    kept = [0, 1, 2]
    while True:
        a = torch.tensor([[terms[t](n) for t in kept] for n in tokens], dtype=torch.float64)
        coef = dict(zip(kept, torch.linalg.lstsq(a, y).solution.squeeze(1).tolist()))
        negative = [t for t in kept if t and coef[t] < 0]
        if not negative:
            break
        kept.remove(negative[0])
    if 2 not in kept:
        return None
    return lambda n: sum(c * terms[t](n) for t, c in coef.items())


def default_knots(max_tokens: int) -> list[int]:
    """Powers of two from 1 up to the token budget (the budget itself the last knot)."""
    knots = [1]
    while knots[-1] * 2 < max_tokens:
        knots.append(knots[-1] * 2)
    if knots[-1] != max_tokens:
        knots.append(max_tokens)
    if len(knots) < 2:
        knots.append(2)
    return knots


@dataclass(frozen=True)
class Roofline:
    """The least a step can cost on this host, from its measured bandwidth and FLOP/s: the weights
    a step reads once at the bandwidth, or its products at the FLOP rate, whichever is longer."""

    weight_bytes: float  # read by every step (a mixture of experts: the share of experts one token reads)
    flops_per_token: float  # 2 x parameters of the products a token runs through
    bandwidth: float  # bytes/s read
    flops: float  # FLOP/s of a large matrix product in the compute dtype
    dispatch_s: float  # what running the layers costs beyond the arithmetic (operator calls), allowed on top

    def __post_init__(self) -> None:
        if not (self.weight_bytes >= 0 and self.flops_per_token >= 0 and self.bandwidth > 0 and self.flops > 0
                and self.dispatch_s >= 0):
            raise ValueError(f"roofline needs positive rates and non-negative sizes: {self}")

    def floor(self, tokens: int) -> float:
        return max(self.weight_bytes / self.bandwidth, self.flops_per_token * tokens / self.flops)
