"""The step-cost model: fitting, monotonicity, online correction, persistence. No model needed."""
from __future__ import annotations

import pytest

from tessera.engine.core import cost_model as cm
from tessera.engine.core.cost_model import CalibrationPoint, StepCostModel, StepShape, calibrate, default_knots


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

    monkeypatch.setattr(cm.time, "perf_counter", lambda: now[0])
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
    cm.save_cached(path, model)
    again = cm.load_cached(path)
    assert again is not None and again.to_dict() == model.to_dict()
    path.write_text("{not json")
    assert cm.load_cached(path) is None
    monkeypatch.setattr(cm, "MAX_CACHED_CALIBRATIONS", 3)
    for i in range(5):
        cm.save_cached(tmp_path / f"m{i}.json", model)
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
