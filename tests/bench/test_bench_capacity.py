"""Capacity search on a synthetic server whose latency grows with the request rate."""
from __future__ import annotations

import pytest

from tessera.bench.capacity import Probe, check_slo, search_capacity
from tessera.bench.metrics import SLO


def summary(ttft_p95: float, itl_p50: float, failed: int = 0, n: int = 20) -> dict:
    return {"num_requests": n, "completed": n - failed, "failed": failed,
            "ttft_s": {"p95": ttft_p95}, "itl_s": {"p50": itl_p50}}


def synthetic(ttft_at, itl_at, slo=SLO()):
    """A probe whose P95 TTFT and P50 ITL are known monotone functions of the rate."""
    seen = []

    def probe(rate: float) -> Probe:
        seen.append(rate)
        s = summary(ttft_at(rate), itl_at(rate))
        ok, reason = check_slo(s, slo)
        return Probe(rate, ok, reason, s)

    return probe, seen


def test_finds_the_ttft_threshold_within_tolerance():
    # TTFT p95 = 0.2 + 0.3·rate crosses 1 s at 8/3 req/s; ITL stays far below its SLO.
    probe, seen = synthetic(lambda r: 0.2 + 0.3 * r, lambda r: 0.01)
    res = search_capacity(probe, start_rate=0.5, max_probes=20, rel_tol=0.01)
    threshold = 8 / 3
    lo, hi = res.bracket
    assert lo <= threshold < hi and (hi - lo) / lo <= 0.01
    assert res.rate == lo and res.rate == pytest.approx(threshold, rel=0.01)
    assert seen[:4] == [0.5, 1.0, 2.0, 4.0]  # geometric growth until the first miss, then bisection
    assert len(seen) < 20


def test_itl_threshold_binds_when_lower():
    # ITL p50 = 0.01·rate crosses 50 ms at 5 req/s, TTFT at 9 req/s.
    probe, _ = synthetic(lambda r: 0.1 * r + 0.1, lambda r: 0.01 * r)
    res = search_capacity(probe, start_rate=1.0, max_probes=30, rel_tol=0.005)
    assert res.rate == pytest.approx(5.0, rel=0.005) and res.rate <= 5.0


def test_shrinks_when_the_first_probe_fails():
    probe, seen = synthetic(lambda r: 10 * r, lambda r: 0.01)  # threshold 0.1 req/s
    res = search_capacity(probe, start_rate=2.0, max_probes=20, min_rate=0.01, rel_tol=0.05)
    assert seen[:3] == [2.0, 1.0, 0.5]
    assert res.rate == pytest.approx(0.1, rel=0.05) and res.rate <= 0.1


def test_probe_budget_is_a_hard_bound_and_reported():
    probe, seen = synthetic(lambda r: 0.2 + 0.3 * r, lambda r: 0.01)
    res = search_capacity(probe, start_rate=0.5, max_probes=5, rel_tol=0.001)
    assert len(seen) == 5 and res.rate is not None and res.rate <= 8 / 3
    assert "max-probes" in res.note


def test_no_rate_meets_the_slo():
    probe, seen = synthetic(lambda r: 5.0, lambda r: 0.01)
    res = search_capacity(probe, start_rate=1.0, max_probes=10, min_rate=0.25)
    assert res.rate is None and seen == [1.0, 0.5, 0.25] and "min-rate" in res.note


def test_every_rate_meets_the_slo_up_to_the_cap():
    probe, seen = synthetic(lambda r: 0.1, lambda r: 0.01)
    res = search_capacity(probe, start_rate=1.0, max_probes=10, max_rate=6.0)
    assert res.rate == 6.0 and seen == [1.0, 2.0, 4.0, 6.0] and "max-rate" in res.note


def test_check_slo_counts_failures_and_percentiles():
    slo = SLO(ttft=1.0, itl=0.05)
    assert check_slo(summary(0.9, 0.04), slo)[0]
    assert not check_slo(summary(1.1, 0.04), slo)[0]
    assert not check_slo(summary(0.9, 0.06), slo)[0]
    assert not check_slo(summary(0.9, 0.04, failed=1), slo)[0]
    assert check_slo(summary(0.9, 0.04, failed=1, n=100), slo, max_failure_share=0.05)[0]
    assert check_slo(summary(0.9, 0.04, failed=20), slo)[1] == "no request completed"


def test_rejects_a_search_that_cannot_move():
    probe, _ = synthetic(lambda r: 0.1, lambda r: 0.01)
    with pytest.raises(ValueError):
        search_capacity(probe, growth=1.0)
    with pytest.raises(ValueError):
        search_capacity(probe, start_rate=0.01, min_rate=0.05)


@pytest.mark.parametrize("dataset,turns", [("random", 4), ("chat", 3), ("multi-turn", 4), ("code-edit", 3)])
def test_a_probe_holds_rate_times_duration_sessions_whatever_their_turns(dataset, turns):
    """The rate counts sessions (the open-loop runner starts one per arrival), so a probe of D
    seconds holds rate x D of them: a chat probe's arrivals last as long as a random one's."""
    from argparse import Namespace

    from tessera.bench.capacity import probes_for
    from tessera.bench.datasets import build_workload

    args = Namespace(dataset=dataset, turns=turns, probe_duration=30.0, min_requests=6, max_requests=10_000)
    for rate in (0.5, 1.7, 4.0):
        n = probes_for(args, rate)
        sessions = build_workload(dataset, n, 0, turns=turns, input_words=(5, 10), output_tokens=(4, 8))
        assert len(sessions) == -(-int(rate * 30 * 1000) // 1000)  # ceil(rate x duration)
        assert sum(len(s.turns) for s in sessions) == n
    args.max_requests = 40  # the request bounds still hold
    assert probes_for(args, 4.0) == 40
