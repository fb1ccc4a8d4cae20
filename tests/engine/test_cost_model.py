"""The step-cost model: fitting, monotonicity, online correction, persistence. No model needed."""
from __future__ import annotations

import pytest

from tessera.engine.core import cost_calibration as cc
from tessera.engine.core import cost_model as cm
from tessera.engine.core.cost_calibration import calibrate
from tessera.engine.core.cost_model import CalibrationPoint, StepCostModel, StepShape, default_knots


def synthetic_step_time(shape: StepShape, multi_ms: float = 0.0) -> float:
    """A machine whose steps cost 5 ms + 0.5 ms per token up to 32 tokens, 0.8 ms beyond,
    0.2 ms per sampled row and 1 ms per 1000 attended pairs, and `multi_ms` more when a chunk
    has several tokens (the modules' path, where one-token rows run as one C call)."""
    t = shape.num_tokens
    layers = 0.5 * min(t, 32) + 0.8 * max(0, t - 32)
    return (5 + layers + 0.2 * shape.num_sampled + shape.num_attended / 1000
            + multi_ms * min(1, shape.num_multi)) / 1000


@pytest.mark.parametrize("multi_ms", [0.0, 30.0])
def test_calibration_recovers_a_known_machine(monkeypatch, multi_ms):
    now = [0.0]  # a fake clock that each synthetic step advances by the machine's step time

    def run_step(chunks):
        shape = StepShape()
        for start, n, samples in chunks:
            shape = shape.plus(StepShape.chunk(start, n, samples))
        now[0] += synthetic_step_time(shape, multi_ms)
        return True

    monkeypatch.setattr(cc.time, "perf_counter", lambda: now[0])
    model = calibrate(run_step, max_tokens=256, max_rows=32, max_context=2048, budget_s=100)
    for shape in (StepShape(1, 1, 300), StepShape(16, 16, 16 * 500), StepShape(32, 32, 32 * 900),
                  StepShape(100, 4, 3000, 1), StepShape(256, 0, 33000, 1), StepShape(96, 32, 4000, 1)):
        assert model.predict(shape) == pytest.approx(synthetic_step_time(shape, multi_ms), rel=0.05), shape
    assert model.knots == default_knots(256)
    assert model.per_multi_step == pytest.approx(multi_ms / 1000, abs=0.005)


def test_fit_is_monotone_and_extrapolates_past_the_measured_steps():
    points = [CalibrationPoint(StepShape(t, 0, 0), 0.001 * (4 + t)) for t in (1, 2, 4, 8, 16)]
    model = StepCostModel.fit(default_knots(64), points)
    times = [model.predict(StepShape(t, 0, 0)) for t in range(1, 200)]
    assert all(b >= a for a, b in zip(times, times[1:]))
    assert model.predict(StepShape(64, 0, 0)) == pytest.approx(0.068, rel=0.05)  # the 8-16 slope, carried on


def test_online_correction_learns_a_slower_machine():
    points = [CalibrationPoint(StepShape(t, 0, 0), 0.001 * (4 + t)) for t in (1, 2, 4, 8, 16, 32)]
    model = StepCostModel.fit(default_knots(32), points)
    shape = StepShape(8, 8, 800)
    before = model.predict(shape)
    for _ in range(200):
        model.observe(shape, 2 * model.predict_raw(shape))
    assert model.predict(shape) == pytest.approx(2 * before, rel=0.02)
    assert model.predict(StepShape(1, 0, 0)) == pytest.approx(0.005, rel=0.05)  # other buckets untouched
    assert model.describe()["observed_steps"] == 200


def test_cache_round_trip_and_pruning(tmp_path, monkeypatch):
    points = [CalibrationPoint(StepShape(t, t % 3, 7 * t, t % 2), 0.001 * (4 + t)) for t in (1, 2, 4, 8)]
    model = StepCostModel.fit(default_knots(8), points, 1.5)
    path = tmp_path / "a.json"
    cc.save_cached(path, model)
    again = cc.load_cached(path)
    assert again is not None and again.to_dict() == model.to_dict()
    path.write_text("{not json")
    assert cc.load_cached(path) is None
    monkeypatch.setattr(cc, "MAX_CACHED_CALIBRATIONS", 3)
    for i in range(5):
        cc.save_cached(tmp_path / f"m{i}.json", model)
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_moe_extrapolation_follows_the_experts_a_step_activates():
    """A mixture of experts' step reads each chosen expert once: its time rises steeply while more
    tokens bring new experts, then flattens. Calibrated up to 8 tokens (a large model's budget
    runs out early) and at the 24 tokens that activate nearly all experts (calibrate() adds that
    step), the model extends to 512 by the expected distinct experts; the last slope would
    overstate a 512-token chunk several times over."""
    from tessera.engine.core.cost_model import StepShape, default_knots, expected_experts

    experts = (32, 4)

    def seconds(n):  # per step 10 ms, per token 0.5 ms, per active expert (of every layer) 20 ms
        return 0.010 + 0.0005 * n + 0.020 * expected_experts(n, experts)

    points = [CalibrationPoint(StepShape(n, 0, 0, 0), seconds(n)) for n in (1, 2, 3, 4, 6, 8, 24) for _ in range(2)]
    knots = default_knots(512)
    moe = StepCostModel.fit(knots, points, experts=experts)
    dense = StepCostModel.fit(knots, points)
    for n in (32, 64, 512):
        assert moe.predict(StepShape(n, 0, 0, 0)) == pytest.approx(seconds(n), rel=0.1)
    assert dense.predict(StepShape(512, 0, 0, 0)) > 3 * seconds(512)
    assert expected_experts(1, experts) == pytest.approx(4) and expected_experts(10_000, experts) == pytest.approx(32)


class FakeHost:
    """A machine on a fake clock: steps cost `synthetic_step_time`, `slowdown` times more while a
    hog spins beside them, and the host-load meter counts the hog's cores over the clock."""

    def __init__(self, hog_attempts: int = 0, slowdown: float = 8.0) -> None:
        self.now = 0.0
        self.others = 0.0  # CPU seconds the hog has used
        self.hog_steps_left = 0
        self.hog_attempts = hog_attempts  # calibrations the hog runs beside
        self.slowdown = slowdown
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def meter(self) -> float:
        return self.others

    def run_step(self, chunks) -> bool:
        shape = StepShape()
        for start, n, samples in chunks:
            shape = shape.plus(StepShape.chunk(start, n, samples))
        dt = synthetic_step_time(shape)
        if self.hogging:
            dt *= self.slowdown
            self.others += dt  # one core's worth beside the step
        self.now += dt
        return True

    @property
    def hogging(self) -> bool:
        return self.hog_attempts > 0

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.hog_attempts -= 1  # the hog ran for one calibration
        self.now += seconds


def checked(host: FakeHost, monkeypatch, **kw):
    monkeypatch.setattr(cc.time, "perf_counter", host.clock)
    return cc.calibrate_checked(host.run_step, max_tokens=256, max_rows=32, max_context=2048, budget_s=100,
                                host_load=host.meter, sleep=host.sleep, **kw)


def test_a_calibration_beside_a_hog_is_measured_again_once_the_hog_is_gone(monkeypatch):
    host = FakeHost(hog_attempts=1)
    model = checked(host, monkeypatch)
    assert host.sleeps == [cc.CalibrationChecks().pause_s]
    assert model.verdict.trusted and model.verdict.attempts == 2 and model.verdict.other_cores == 0
    shape = StepShape(16, 16, 16 * 500)
    assert model.predict(shape) == pytest.approx(synthetic_step_time(shape), rel=0.05)


def test_a_calibration_beside_a_hog_that_stays_is_refused_storage_and_corrected_online(monkeypatch, tmp_path):
    host = FakeHost(hog_attempts=99)
    model = checked(host, monkeypatch)
    assert not model.verdict.trusted
    assert "other processes took 1.00 cores" in model.verdict.problems[0]
    assert model.describe()["calibration_trusted"] is False
    path = tmp_path / "m.json"
    cc.save_cached(path, model)
    assert not path.exists()
    # Serving: the hog is gone. The first real step in a bucket replaces its correction, and the
    # buckets not seen yet borrow the nearest seen one's, so prompt chunks are not sized by 8x costs.
    small, large = StepShape(4, 4, 4 * 300), StepShape(200, 0, 20000, 1)
    assert model.predict(small) == pytest.approx(8 * synthetic_step_time(small), rel=0.1)
    model.observe(small, synthetic_step_time(small))
    assert model.predict(small) == pytest.approx(synthetic_step_time(small), rel=0.05)
    assert model.predict(large) == pytest.approx(synthetic_step_time(large), rel=0.2)  # not 8x


def test_a_trusted_calibration_learns_slowly_and_keeps_its_buckets_apart():
    points = [CalibrationPoint(StepShape(t, 0, 0), 0.001 * (4 + t)) for t in (1, 2, 4, 8, 16, 32)]
    model = StepCostModel.fit(default_knots(32), points)
    model.observe(StepShape(1, 0, 0), 0.010)  # twice the prediction
    assert model.predict(StepShape(1, 0, 0)) == pytest.approx(0.005 * 1.05, rel=1e-3)
    assert model.predict(StepShape(32, 0, 0)) == pytest.approx(0.036, rel=1e-3)


def test_real_hog_is_seen_by_the_host_load_meter():
    """A real process spinning on a core for a second counts as about one core of others' CPU."""
    import subprocess
    import sys
    import time

    from tessera.hostinfo import others_cpu_seconds

    hog = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.2)
        before, t0 = others_cpu_seconds(), time.perf_counter()
        time.sleep(1.0)
        cores = (others_cpu_seconds() - before) / (time.perf_counter() - t0)
    finally:
        hog.wait()
    assert cores > 0.7


def test_disagreeing_samples_are_measured_again_and_their_median_kept(monkeypatch):
    now = [0.0]
    hiccups = {4: [0.004, 0.040, 0.005, 0.004, 0.006]}  # the 4-token step: a 10x hiccup on its second sample
    calls: dict[int, int] = {}

    def run_step(chunks):
        tokens = sum(n for _, n, _ in chunks)
        calls[tokens] = calls.get(tokens, 0) + 1
        series = hiccups.get(tokens) if len(chunks) == 1 and not chunks[0][2] else None
        # calibration's warm-up step is not one of these shapes' samples
        now[0] += series[calls[tokens] - 1] if series else 0.004 + 0.0001 * tokens
        return True

    monkeypatch.setattr(cc.time, "perf_counter", lambda: now[0])
    model = calibrate(run_step, max_tokens=16, max_rows=1, max_context=64, budget_s=100)
    point = next(p for p in model.calibration if p.shape == StepShape(4, 0, 10, 1))
    assert calls[4] >= 5 and point.seconds == pytest.approx(0.005)


def test_a_step_that_breaks_monotonicity_is_measured_again(monkeypatch):
    """Both samples of the 8-token step hit a slow patch (they agree, so nothing looks wrong),
    but it then costs more than the 16-token step: it is measured again and the median kept."""
    now = [0.0]
    seen = {"slow": 2}

    def run_step(chunks):
        tokens = sum(n for _, n, _ in chunks)
        cost = 0.004 + 0.0002 * tokens
        if tokens == 8 and len(chunks) == 1 and not chunks[0][2] and seen["slow"] > 0:
            seen["slow"] -= 1
            cost *= 3
        now[0] += cost
        return True

    monkeypatch.setattr(cc.time, "perf_counter", lambda: now[0])
    model = calibrate(run_step, max_tokens=16, max_rows=1, max_context=64, budget_s=100)
    point = next(p for p in model.calibration if p.shape.num_tokens == 8 and p.shape.num_sampled == 0)
    assert point.seconds == pytest.approx(0.004 + 0.0016)
    assert cc.monotone_violations(model.calibration, 0.3) == []


def test_roofline_bounds_refuse_impossible_calibrations():
    roofline = cm.Roofline(weight_bytes=100e6, flops_per_token=2e8, bandwidth=20e9, flops=100e9, dispatch_s=0.01)
    assert roofline.floor(1) == pytest.approx(0.005) and roofline.floor(1000) == pytest.approx(2.0)
    checks = cc.CalibrationChecks()

    def fitted(per_token_s: float, base_s: float) -> StepCostModel:
        pts = [CalibrationPoint(StepShape(t, 0, 0), base_s + per_token_s * t) for t in (1, 2, 4, 8, 16)]
        return StepCostModel.fit(default_knots(1024), pts)

    assert cc.check_calibration(fitted(0.004, 0.020), checks, roofline, 0.0) == []
    too_slow = cc.check_calibration(fitted(0.5, 0.020), checks, roofline, 0.0)  # 16 tokens 8 s: 20x is 1.6 s
    assert len(too_slow) == 1 and "exceed 20x the roofline" in too_slow[0]
    too_fast = cc.check_calibration(fitted(0.00001, 0.0005), checks, roofline, 0.0)  # faster than the weights' read
    assert len(too_fast) == 1 and "measured bandwidth" in too_fast[0]
    busy = cc.check_calibration(fitted(0.004, 0.020), checks, roofline, 1.2)
    assert len(busy) == 1 and "1.20 cores" in busy[0]


def test_unchecked_and_untrusted_files_are_not_reused(tmp_path):
    import json

    points = [CalibrationPoint(StepShape(t, 0, 0), 0.001 * (4 + t)) for t in (1, 2, 4, 8)]
    model = StepCostModel.fit(default_knots(8), points, 1.0)
    path = tmp_path / "m.json"
    cc.save_cached(path, model)
    d = json.loads(path.read_text())
    assert d["checks"] == {"other_cores": None, "attempts": 1, "problems": []}
    for stale in ({k: v for k, v in d.items() if k not in ("format", "checks")},  # written before the checks
                  {**d, "checks": {"other_cores": 1.5, "attempts": 2, "problems": ["busy"]}}):
        path.write_text(json.dumps(stale))
        assert cc.load_cached(path) is None


def test_a_stored_calibration_the_corrections_show_wrong_is_removed(tmp_path):
    points = [CalibrationPoint(StepShape(t, 0, 0), 0.001 * (4 + t)) for t in (1, 2, 4, 8, 16, 32)]
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    for path, factor in ((good, 1.6), (bad, 0.3)):  # real steps at 1.6x the prediction, or 0.3x
        model = StepCostModel.fit(default_knots(32), points)
        cc.save_cached(path, model)
        stored = cc.StoredCalibration(path)
        for _ in range(cm.DRIFT_MIN_STEPS * 2):
            model.observe(StepShape(8, 0, 0), factor * model.predict_raw(StepShape(8, 0, 0)))
            stored.review(model)
    assert good.exists() and not bad.exists()


def test_knots_past_the_measured_steps_are_lifted_to_the_roofline(monkeypatch):
    """Measured only up to 16 tokens, where the weights' read dominates, the last slope would put
    a 256-token step far below what its products take at the host's FLOP rate."""
    roofline = cm.Roofline(weight_bytes=1e6, flops_per_token=2e8, bandwidth=1e9, flops=1e11, dispatch_s=0.05)
    now = [0.0]

    def run_step(chunks):
        tokens = sum(n for _, n, _ in chunks)
        now[0] += max(0.004, roofline.floor(tokens) * 2)  # memory-bound to 16 tokens, then twice the roofline
        return True

    monkeypatch.setattr(cc.time, "perf_counter", lambda: now[0])
    model = cc.calibrate_checked(run_step, max_tokens=256, max_rows=1, max_context=64, budget_s=0.05,
                                 roofline=roofline)
    assert max(p.shape.num_tokens for p in model.calibration) < 256
    assert model.predict(StepShape(256, 0, 0, 1)) >= roofline.floor(256)
    times = [model.predict(StepShape(t, 0, 0, 1)) for t in range(2, 257)]
    assert all(b >= a for a, b in zip(times, times[1:]))


def test_cores_the_calibration_leaves_free_may_be_busy(monkeypatch):
    """Another replica calibrating on the core this one's threads leave free is no hog."""
    host = FakeHost(hog_attempts=99)
    model = checked(host, monkeypatch, spare_cores=1.0)
    assert model.verdict.trusted and host.sleeps == [] and model.verdict.other_cores == pytest.approx(1.0)


def test_an_untrusted_calibration_is_never_reviewed_for_removal(tmp_path):
    points = [CalibrationPoint(StepShape(t, 0, 0), 0.001 * (4 + t)) for t in (1, 2, 4, 8)]
    model = StepCostModel.fit(default_knots(8), points)
    model.verdict = cm.CalibrationVerdict(1.0, 2, ("busy",))
    stored = cc.StoredCalibration(tmp_path / "never-written.json")
    for _ in range(cm.DRIFT_MIN_STEPS * 2):
        model.observe(StepShape(8, 0, 0), 0.3 * model.predict_raw(StepShape(8, 0, 0)))
        stored.review(model)
    assert model.drift() is not None and stored.removed is None
