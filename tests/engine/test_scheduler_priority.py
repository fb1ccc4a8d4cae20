"""The priority policy: admission, the token budget and preemption by `priority` (lower first),
background work only in the room the latency target leaves, and the forecast per class."""
from __future__ import annotations

from dataclasses import dataclass

from tessera.config import EngineConfig
from tessera.engine.core.cost_model import StepShape
from tessera.engine.core.kv_cache_manager import KVCacheManager
from tessera.engine.core.request import Request, RequestStatus
from tessera.engine.core.scheduler import Scheduler
from tessera.sampling_params import SamplingParams

EOS = 0


@dataclass
class LinearCost:
    """Step time: 10 ms + 1 ms a token, + 20 ms for a step with a prompt chunk."""

    def predict(self, shape: StepShape) -> float:
        if not shape.num_tokens:
            return 0.0
        return (10 + shape.num_tokens + 20 * min(1, shape.num_multi)) / 1000


def make(policy: str = "priority", max_seqs: int = 4, blocks: int = 64, target_ms: float = 0.0,
         budget: int = 64) -> Scheduler:
    cfg = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, block_size=4,
                       enable_prefix_caching=False, preemption_mode="recompute", target_itl_ms=target_ms,
                       min_prefill_chunk=4, scheduling_policy=policy, background_priority=100)
    kv = KVCacheManager(blocks, 4, False)
    return Scheduler(cfg, kv, 256, LinearCost() if target_ms else None)


def req(rid: str, priority: int = 0, prompt: int = 8, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens, priority=priority),
                   max_tokens, [EOS])


def step(s: Scheduler) -> list[str]:
    """One step with every sampled row given a non-stop token; the ids scheduled."""
    out = s.schedule()
    s.update_after_step(out, {c.request_id: [7] for c in out.scheduled if c.samples})
    return [c.request_id for c in out.scheduled]


def test_higher_priority_is_admitted_first() -> None:
    s = make(max_seqs=1)
    s.add_request(req("low", priority=10))
    s.add_request(req("high", priority=0))
    assert [r.request_id for r in s.waiting] == ["high", "low"]
    assert step(s) == ["high"]


def test_fcfs_ignores_priority() -> None:
    s = make(policy="fcfs", max_seqs=1)
    s.add_request(req("low", priority=10))
    s.add_request(req("high", priority=0))
    assert step(s) == ["low"]


def test_a_higher_priority_newcomer_preempts_a_lower_running_one() -> None:
    s = make(max_seqs=1)
    s.add_request(req("low", priority=10, max_tokens=50))
    step(s)
    step(s)
    s.add_request(req("high", priority=0))
    assert step(s) == ["high"]
    low = s.requests["low"]
    assert low.status == RequestStatus.PREEMPTED and s.num_preemptions == 1
    while s.requests.get("high") is not None:
        step(s)
    assert "low" in step(s)  # it resumes once the higher one is done


def test_equal_priority_does_not_preempt() -> None:
    s = make(max_seqs=1)
    s.add_request(req("first", priority=5, max_tokens=50))
    step(s)
    s.add_request(req("second", priority=5))
    assert step(s) == ["first"] and s.num_preemptions == 0


def test_blocks_go_to_the_higher_priority_prompt() -> None:
    s = make(max_seqs=4, blocks=8)  # 32 tokens of KV
    s.add_request(req("low", priority=10, prompt=20, max_tokens=8))
    step(s)
    s.add_request(req("high", priority=0, prompt=20, max_tokens=4))
    assert "high" in step(s)
    assert s.requests["low"].status == RequestStatus.PREEMPTED


def test_background_work_fills_only_the_slack_beside_interactive_decodes() -> None:
    s = make(max_seqs=8, target_ms=100)
    s.add_request(req("chat", prompt=8, max_tokens=40))
    step(s)  # its prompt
    s.add_request(req("batch", priority=100, prompt=8))
    for _ in range(5):  # a decode step of 11 ms leaves 0.55 ms: no room for a 28 ms prompt chunk
        assert step(s) == ["chat"]
    assert s.requests["batch"].status == RequestStatus.WAITING


def test_background_work_runs_in_the_gaps_within_the_target() -> None:
    s = make(max_seqs=8, target_ms=100, budget=128)
    s.add_request(req("batch", priority=100, prompt=100))
    out = s.schedule()  # alone: up to the target (100 ms = 10 + 20 + 70 tokens), not the budget
    assert [c.num_new_tokens for c in out.scheduled] == [70]


def test_interactive_waiting_blocks_background_admission() -> None:
    s = make(max_seqs=1, target_ms=100)
    s.add_request(req("batch", priority=100))
    s.add_request(req("chat", priority=0))
    assert step(s) == ["chat"]


def test_forecast_ignores_a_lower_priority_backlog() -> None:
    s = make(max_seqs=2, target_ms=100)
    for i in range(20):
        s.add_request(req(f"b{i}", priority=100, prompt=50))
    snap = s.load_snapshot()
    assert snap.waiting_ahead_of(0) == 0 and snap.waiting_ahead_of(100) == 20
    assert s.predict_wait(snap, 10, priority=0) < s.predict_wait(snap, 10, priority=100) / 10
    fcfs = make(policy="fcfs", max_seqs=2, target_ms=100)
    for i in range(20):
        fcfs.add_request(req(f"b{i}", priority=100, prompt=50))
    snap = fcfs.load_snapshot()
    assert fcfs.predict_wait(snap, 10, priority=0) == fcfs.predict_wait(snap, 10, priority=100)


def test_stats_count_each_class() -> None:
    s = make(max_seqs=1)
    s.add_request(req("a", priority=0))
    s.add_request(req("b", priority=3))
    s.add_request(req("c", priority=3))
    step(s)
    assert s.stats().requests_by_priority == ((0, 1, 0), (3, 0, 2))


def test_background_work_alone_always_moves() -> None:
    """A cost model predicting every step past the background's share of the target must not
    stall a server that has only background work."""
    s = make(max_seqs=8, target_ms=20)  # its share, 10 ms, is below any step's 11 ms
    for i in range(3):
        s.add_request(req(f"b{i}", priority=100, prompt=4, max_tokens=3))
    for _ in range(30):
        if not s.has_unfinished():
            break
        assert step(s)
    assert not s.has_unfinished()


def test_a_gap_on_a_host_slower_than_the_target_admits_more_than_one_prompt() -> None:
    """Decodes alone past the target: prompts may take the step to 1.5x the decodes with a least
    chunk, so more than one background request starts a step (one a step starved a slow host's
    batch)."""
    s = make(max_seqs=16, target_ms=12, budget=256)
    s.add_request(req("running", priority=100, prompt=4, max_tokens=50))
    step(s)
    for i in range(6):
        s.add_request(req(f"b{i}", priority=100, prompt=6))
    assert len(step(s)) >= 3


def test_a_lower_class_prompt_does_not_spend_a_higher_class_decodes_latency() -> None:
    """Beside a priority-0 decode with little room under the target, a priority-10 prompt gets only
    what fits (under fcfs the step gives way and takes the whole budget for it)."""
    for policy, low_tokens, unbounded in (("priority", 1, None), ("fcfs", 40, "past_target")):
        s = make(policy=policy, max_seqs=4, target_ms=20)
        s.add_request(req("chat", prompt=8, max_tokens=40))
        step(s)
        s.add_request(req("low", priority=10, prompt=40))
        out = s.schedule()
        assert {c.request_id: c.num_new_tokens for c in out.scheduled} == {"chat": 1, "low": low_tokens}, policy
        assert out.prefill_unbounded == unbounded


def _decoding(s: Scheduler, n: int, priority: int) -> None:
    """`n` requests of `priority` decoding (their prompts computed)."""
    for i in range(n):
        s.add_request(req(f"d{priority}-{i}", priority=priority, prompt=4, max_tokens=200))
    for _ in range(2 * n + 2):
        step(s)
        if len(s.running) == n and all(r.num_output_tokens >= 1 for r in s.running):
            return
    raise AssertionError("the prompts did not finish")


def test_a_newcomer_giving_way_is_not_joined_by_lower_class_prompts() -> None:
    """Three priority-10 decodes leave no room under the target, so a priority-0 newcomer's prompt
    makes the step give way; the priority-10 prompts waiting behind it get only what fits under
    the target (nothing), not the rest of the budget: its first token waits for its own prompt
    alone."""
    s = make(max_seqs=8, target_ms=30, budget=64)
    _decoding(s, 3, priority=10)
    s.add_request(req("w1", priority=10, prompt=16))
    s.add_request(req("w2", priority=10, prompt=16))
    s.add_request(req("hi", priority=0, prompt=8))
    out = s.schedule()
    new = {c.request_id: c.num_new_tokens for c in out.scheduled if not c.is_decode}
    assert new == {"hi": 8} and out.prefill_unbounded == "past_target"


def test_a_lower_class_gives_way_only_up_to_a_bound_once_a_better_class_was_served() -> None:
    """Priority-10 prompts past the target take the whole budget while priority 10 is the best
    class the server has seen; once a priority-0 request has come, a step given way for them is
    bounded (decodes with one least chunk), since a priority-0 arrival would wait for it."""
    for seen_better, tokens in ((False, 60), (True, 4)):
        s = make(max_seqs=8, target_ms=30, budget=64)
        if seen_better:
            s.add_request(req("earlier", priority=0, prompt=4, max_tokens=1))
            step(s)
            assert not s.has_unfinished()
        _decoding(s, 3, priority=10)
        s.add_request(req("w", priority=10, prompt=60))
        out = s.schedule()
        assert {c.request_id: c.num_new_tokens for c in out.scheduled if not c.is_decode} == {"w": tokens}
        assert out.prefill_unbounded == "past_target"


def test_forecast_follows_the_bound_on_a_lower_class() -> None:
    """The wait forecast for a priority-10 prompt past the target: the whole budget a step while
    priority 10 is the best class seen, least chunks once a priority-0 request has come."""
    waits = []
    for seen_better in (False, True):
        s = make(max_seqs=8, target_ms=30, budget=64)
        if seen_better:
            s.add_request(req("earlier", priority=0, prompt=4, max_tokens=1))
            step(s)
        _decoding(s, 3, priority=10)
        snap = s.load_snapshot()
        assert snap.best_priority_seen == (0 if seen_better else 10)
        waits.append(s.predict_wait(snap, 60, priority=10))
    assert waits[1] > 2 * waits[0]


def test_a_request_counts_the_steps_its_prompt_waited_for() -> None:
    """Each request's metrics count the steps that computed its prompt and all the tokens those
    steps computed (what the trace shows of a slow first token)."""
    s = make(max_seqs=4, budget=8)
    s.add_request(req("a", prompt=12, max_tokens=2))
    s.add_request(req("b", prompt=4, max_tokens=2))
    step(s)  # a: 8 of 12
    step(s)  # a: the last 4, b: its 4
    a, b = s.requests["a"].metrics, s.requests["b"].metrics
    assert (a.prompt_steps, a.prompt_step_tokens) == (2, 16)
    assert (b.prompt_steps, b.prompt_step_tokens) == (1, 8)
    step(s)  # decodes do not count
    assert a.prompt_steps == 2


def test_a_step_of_prompts_alone_is_bounded_and_led_by_the_best_class() -> None:
    """Without decodes a step's prompts take the budget, but its first prompt's class sets it: a
    priority-10 prompt there is bounded once priority 0 was served, and a priority-0 prompt is not
    joined by priority-10 prompts beyond the target."""
    for seen_better, tokens in ((False, 60), (True, 4)):
        s = make(max_seqs=8, target_ms=30, budget=64)
        if seen_better:
            s.add_request(req("earlier", priority=0, prompt=4, max_tokens=1))
            step(s)
        s.add_request(req("w", priority=10, prompt=60))
        out = s.schedule()
        assert {c.request_id: c.num_new_tokens for c in out.scheduled} == {"w": tokens}
    s = make(max_seqs=8, target_ms=30, budget=64)
    s.add_request(req("w", priority=10, prompt=16))
    s.add_request(req("hi", priority=0, prompt=8))
    assert {c.request_id: c.num_new_tokens for c in s.schedule().scheduled} == {"hi": 8}
