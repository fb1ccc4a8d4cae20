"""The step-cost model's calibration: synthetic steps measured and fitted at start-up, checked
before the fit is trusted or stored (`calibrate_checked`: monotone in work, within the host's
roofline, no other process busy meanwhile; see cost_model.py's docstring), and the stored fits
(`load_cached`, `save_cached`, `StoredCalibration`)."""
from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol, Sequence

from tessera.engine.core.cost_model import (CALIBRATION_FORMAT, DRIFT_MIN_STEPS, CalibrationPoint, CalibrationVerdict,
                                            Roofline, StepCostModel, StepShape, default_knots)

logger = logging.getLogger("tessera")

MAX_CACHED_CALIBRATIONS = 64


RunStep = Callable[[list[tuple[int, int, bool]]], bool]


class HostLoadMeter(Protocol):
    """A counter of the CPU seconds other processes have used (hostinfo.others_cpu_seconds; a fake
    one in tests): read before and after a calibration, it says how busy the host was."""

    def __call__(self) -> Optional[float]:
        """Seconds so far, or None where the host does not say."""
        ...


@dataclass(frozen=True)
class CalibrationChecks:
    """When a calibration is trusted (module docstring); the defaults leave a quiet host's
    calibration alone and refuse one taken beside a process spinning on a core."""

    max_other_cores: float = 0.3  # CPU other processes may take during it, in cores
    attempts: int = 2  # calibrations tried before one that fails serves this run only
    pause_s: float = 1.0  # between attempts: a compiler or a test run may be done by then
    disagree: float = 0.3  # two samples of a shape further apart than this are measured again
    extra_samples: int = 3  # taken then; the median of all is kept
    monotone_slack: float = 0.3  # a step of no more work may cost this much more (plus 0.5 ms) and pass
    max_over_roofline: float = 20.0  # a knot above this multiple of the roofline (plus dispatch) is refused
    min_of_bandwidth_floor: float = 0.5  # a step below this share of the bandwidth floor is refused

    def __post_init__(self) -> None:
        if self.max_other_cores < 0 or self.attempts < 1 or self.pause_s < 0 or self.disagree <= 0 \
                or self.extra_samples < 0 or self.monotone_slack < 0 or self.max_over_roofline <= 1 \
                or not 0 <= self.min_of_bandwidth_floor <= 1:
            raise ValueError(f"invalid calibration checks: {self}")


def _measure(run_step: RunStep, chunks: list[tuple[int, int, bool]], checks: CalibrationChecks,
             clock: Callable[[], float], extra: bool = False) -> Optional[list[float]]:
    """Samples of one step: two, and `extra_samples` more when they disagree (or `extra`); None if
    it does not fit."""
    times: list[float] = []
    for i in range(2 + checks.extra_samples):
        if i == 2 and not extra and max(times) <= min(times) * (1 + checks.disagree):
            break
        t0 = clock()
        if not run_step(chunks):
            return None
        times.append(clock() - t0)
    return times


def _kept(times: list[float]) -> float:
    """Two samples that agree: the faster (the slower caught a hiccup); more: their median."""
    return min(times) if len(times) <= 2 else statistics.median(times)


def _shape_of(chunks: list[tuple[int, int, bool]]) -> StepShape:
    total = StepShape()
    for start, n, samples in chunks:
        total = total.plus(StepShape.chunk(start, n, samples))
    return total


def _dominates(a: StepShape, b: StepShape) -> bool:
    """`a` does at least the work of `b` in every term of the model."""
    return (a.num_tokens >= b.num_tokens and a.num_sampled >= b.num_sampled and a.num_attended >= b.num_attended
            and a.num_multi >= b.num_multi)


def monotone_violations(points: Sequence[CalibrationPoint], slack: float) -> list[tuple[int, int]]:
    """Pairs (i, j) where step i does no more work than step j in any term yet cost more than
    (1 + slack) times it plus 0.5 ms: one of the two was disturbed."""
    return [(i, j) for i, p in enumerate(points) for j, q in enumerate(points)
            if i != j and p.shape != q.shape and _dominates(q.shape, p.shape)
            and p.seconds > q.seconds * (1 + slack) + 0.0005]


def calibrate(run_step: RunStep, *, max_tokens: int, max_rows: int,
              max_context: int, budget_s: float = 3.0, prefill_only: bool = False,
              experts: Optional[tuple[int, int]] = None,
              checks: CalibrationChecks = CalibrationChecks()) -> StepCostModel:
    """Measure synthetic steps and fit a model.

    `run_step(chunks)` executes one step made of chunks (start, num_tokens, samples) on
    scratch KV blocks and returns False when the KV cache cannot hold it (skipped). Prefill-only steps cover the knots (smallest first), decode-only
    steps cover rows x context; each shape is measured twice after a warm-up, keeping the
    faster (the slower one caught a hiccup), or, when the two disagree, more times, keeping the
    median; steps that break monotonicity (`monotone_violations`) are measured again the same way.
    When `budget_s` runs out the larger shapes
    are skipped and the model extrapolates them until real steps correct it (`experts`: a mixture
    of experts' (E, k), see the module docstring). `prefill_only`
    (an encoder, whose every step is whole inputs and nothing decodes): the knots, and batches
    of 64-token inputs in place of the decode and mixed steps.
    """
    clock = time.perf_counter
    knots = default_knots(max_tokens)
    shapes: list[list[tuple[int, int, bool]]] = []
    rows = sorted({1, min(4, max_rows), min(16, max_rows), max_rows})
    contexts = sorted({min(64, max_context - 1), min(1024, max_context - 1)})
    for k in knots:  # an encoder's input is at most max_context long: a larger knot is several inputs
        shapes.append([(0, k, False)] if not prefill_only or k <= max_context else
                      [(0, max_context, False)] * (k // max_context) + [(0, k % max_context, False)] * (k % max_context > 0))
    if prefill_only:
        n = min(64, max_context - 1)
        shapes += [[(0, n, False)] * r for r in rows[1:] if r * n <= max_tokens]
    else:
        for r in rows:  # decodes: they are cheap and anchor the small-token end
            for c in contexts:
                if c >= 1:
                    shapes.append([(c, 1, True)] * r)
        for r in rows[1:]:  # a few mixed steps: decodes next to a chunk
            k = max(1, min(max_tokens - r, 64))
            shapes.append([(min(64, max_context - 1), 1, True)] * r + [(0, k, False)])
    shapes.sort(key=lambda chunks: sum(n for _, n, _ in chunks))

    t_start = clock()
    run_step(shapes[len(shapes) // 3])  # warm-up: first-call allocations, thread pool start
    measured: list[tuple[list[tuple[int, int, bool]], list[float]]] = []
    for chunks in shapes:
        spent = clock() - t_start
        if len(measured) >= 2 and spent + 2 * _kept(measured[-1][1]) > budget_s:  # two at least, however slow
            break
        times = _measure(run_step, chunks, checks, clock)
        if times:
            measured.append((chunks, times))
    if experts is not None:
        # Steps below, at and past the ~3E/k tokens that activate nearly every expert, whatever the
        # budget (a large model's runs out after a decode or two): without them the per-token and
        # per-expert costs cannot be told apart, and the extension past the measured knots (see
        # the module docstring) would guess, by the last slope: minutes for a long prompt.
        # A decode at a long context too, which tells attention's cost from the layers'.
        saturating = math.ceil(3 * experts[0] / experts[1])
        needed = [[(0, min(n, max_tokens, max_context - 1), False)]
                  for n in sorted({max(2, saturating // 3), saturating, 2 * saturating})]
        needed.append([(contexts[-1], 1, True)])
        for chunks in needed:  # two samples at least: the first call of a new size pays for its allocations
            if not any(_shape_of(c) == _shape_of(chunks) for c, _ in measured):
                times = _measure(run_step, chunks, checks, clock)
                if times:
                    measured.append((chunks, times))
    if len(measured) < 2:
        raise ValueError("step-cost calibration could not run two steps (KV cache too small?)")
    points = [CalibrationPoint(_shape_of(c), _kept(t)) for c, t in measured]
    for i in sorted({k for pair in monotone_violations(points, checks.monotone_slack) for k in pair}):
        chunks, times = measured[i]  # one more round for each step of a pair that disagrees
        again = _measure(run_step, chunks, checks, clock, extra=True)
        if again:
            times.extend(again)
            points[i] = CalibrationPoint(points[i].shape, statistics.median(times))
    model = StepCostModel.fit(knots, points, clock() - t_start, experts)
    largest = max(p.shape.num_tokens for p in points)
    if largest < max_tokens:
        logger.info("step-cost calibration stopped at %d tokens (budget %.1f s); larger steps are "
                    "extrapolated and corrected online", largest, budget_s)
    return model


def check_calibration(model: StepCostModel, checks: CalibrationChecks, roofline: Optional[Roofline],
                      other_cores: Optional[float], spare_cores: float = 0.0) -> list[str]:
    """What is wrong with a calibration (empty: nothing): a busy host (other processes took more
    than the `spare_cores` this process's threads leave free, plus `checks.max_other_cores`: two
    replicas of one thread each calibrate side by side on two cores without disturbing each
    other), steps that break monotonicity after their re-measurement, knots outside the
    roofline's bounds."""
    problems = []
    if other_cores is not None and other_cores > spare_cores + checks.max_other_cores:
        problems.append(f"other processes took {other_cores:.2f} cores during it "
                        f"(more than {spare_cores + checks.max_other_cores:g})")
    pts = model.calibration
    for i, j in monotone_violations(pts, checks.monotone_slack)[:1]:
        problems.append(f"a step of {pts[i].shape.num_tokens} tokens took {pts[i].seconds * 1000:.1f} ms, "
                        f"more than the larger step of {pts[j].shape.num_tokens} ({pts[j].seconds * 1000:.1f} ms)")
    if roofline is not None:
        bandwidth_floor = roofline.weight_bytes / roofline.bandwidth
        for p in pts:
            if p.seconds < checks.min_of_bandwidth_floor * bandwidth_floor:
                problems.append(f"a step of {p.shape.num_tokens} tokens took {p.seconds * 1000:.2f} ms, under "
                                f"{checks.min_of_bandwidth_floor:g}x the {bandwidth_floor * 1000:.2f} ms reading "
                                "the weights takes at the measured bandwidth")
                break
        for k, sec in zip(model.knots, model.knot_seconds):
            bound = checks.max_over_roofline * roofline.floor(k) + roofline.dispatch_s
            if sec > bound:
                problems.append(f"{k} tokens at {sec * 1000:.1f} ms exceed {checks.max_over_roofline:g}x the "
                                f"roofline ({roofline.floor(k) * 1000:.2f} ms) plus {roofline.dispatch_s * 1000:.0f} ms "
                                "of dispatch")
                break
    return problems


def calibrate_checked(run_step: RunStep, *, max_tokens: int, max_rows: int, max_context: int,
                      budget_s: float = 3.0, prefill_only: bool = False,
                      experts: Optional[tuple[int, int]] = None,
                      checks: CalibrationChecks = CalibrationChecks(), roofline: Optional[Roofline] = None,
                      host_load: Optional[HostLoadMeter] = None, spare_cores: float = 0.0,
                      sleep: Callable[[float], None] = time.sleep) -> StepCostModel:
    """`calibrate`, checked (`check_calibration`) and measured again after a pause while it
    fails, at most `checks.attempts` times; the result's `verdict` says whether it may be stored.
    Of failed attempts the one taken on the quietest host is kept."""
    busy = spare_cores + checks.max_other_cores
    best: Optional[StepCostModel] = None
    for attempt in range(1, checks.attempts + 1):
        before, t0 = host_load() if host_load else None, time.perf_counter()
        model = calibrate(run_step, max_tokens=max_tokens, max_rows=max_rows, max_context=max_context,
                          budget_s=budget_s, prefill_only=prefill_only, experts=experts, checks=checks)
        after, wall = host_load() if host_load else None, time.perf_counter() - t0
        if roofline is not None:
            model.raise_to(roofline)
        other = None if before is None or after is None or wall <= 0 else max(0.0, (after - before) / wall)
        model.verdict = CalibrationVerdict(other, attempt,
                                           tuple(check_calibration(model, checks, roofline, other, spare_cores)))
        if model.verdict.trusted:
            return model
        logger.warning("step-cost calibration %d of %d not trusted: %s", attempt, checks.attempts,
                       "; ".join(model.verdict.problems))
        if best is None or (other or 0.0) < (best.verdict.other_cores or 0.0):
            best = model
        if attempt < checks.attempts and other is not None and other > busy:
            sleep(checks.pause_s)  # busy: give whatever ran beside it a moment; noise alone retries at once
    assert best is not None
    best.verdict = CalibrationVerdict(best.verdict.other_cores, checks.attempts, best.verdict.problems)
    logger.warning("step-cost model: serving with an untrusted calibration, not stored; real steps replace "
                   "its corrections from the first one")
    return best


def load_cached(path: Path) -> Optional[StepCostModel]:
    """A calibration saved by save_cached() and checked when it was taken, or None if absent,
    unreadable, of another format or unchecked (then recalibrate)."""
    try:
        d = json.loads(path.read_text())
        if d.get("format") != CALIBRATION_FORMAT:
            return None
        model = StepCostModel.from_dict(d)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return model if model.verdict.trusted else None


def save_cached(path: Path, model: StepCostModel) -> None:
    """Write atomically; a cache that cannot be written only costs the next start-up a calibration.
    An untrusted calibration is never written."""
    if not model.verdict.trusted:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.partial")
        tmp.write_text(json.dumps(model.to_dict()))
        os.replace(tmp, path)
        saved = sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for old in saved[:-MAX_CACHED_CALIBRATIONS]:  # the oldest go: models and settings no longer used
            old.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("could not save the step-cost calibration to %s: %s", path, exc)


class StoredCalibration:
    """The file a served calibration came from or went to: deleted once the online corrections
    show the calibration wrong (`StepCostModel.drift`), so the next start measures again instead
    of starting from it. Checked every DRIFT_MIN_STEPS observed steps."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.removed: Optional[str] = None  # why, once removed

    def review(self, model: StepCostModel) -> None:
        if self.removed is not None or not model.verdict.trusted or model.observations % DRIFT_MIN_STEPS:
            return  # an untrusted calibration was never stored
        why = model.drift()
        if why is None:
            return
        self.removed = why
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("could not remove the step-cost calibration %s: %s", self.path, exc)
            return
        logger.warning("step-cost model: %s; removed the stored calibration %s, the next start measures again",
                       why, self.path)
