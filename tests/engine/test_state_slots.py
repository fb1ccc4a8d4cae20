"""Per-request state slots (engine/core/state_slots.py) in the KV cache manager and the scheduler:
taken at admission, carried in every chunk, released on finish, abort and preemption, never
more requests running than slots."""
from __future__ import annotations

from tessera.config import EngineConfig
from tessera.engine.core.kv_cache_manager import KVCacheManager
from tessera.engine.core.request import Request, RequestStatus
from tessera.engine.core.scheduler import Scheduler
from tessera.engine.core.state_slots import StateSlots
from tessera.sampling_params import SamplingParams


def _req(rid: str, n: int = 8, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), max_tokens, [0])


def test_slots_are_handed_out_lowest_first_and_returned() -> None:
    slots = StateSlots(3)
    assert [slots.take(r) for r in "abc"] == [0, 1, 2]
    assert slots.take("d") is None and not slots.can_take("d") and slots.can_take("a")
    assert slots.take("b") == 1  # a holder keeps its slot
    slots.release("b")
    slots.release("b")  # twice is harmless
    assert slots.num_used == 2 and slots.take("d") == 1


def test_the_manager_takes_a_slot_with_the_first_blocks_and_frees_it_with_them() -> None:
    kv = KVCacheManager(16, 4, enable_caching=True, num_host_blocks=8, num_state_slots=2)
    assert not kv.enable_caching  # a hit would skip the state of the tokens it covers
    a, b, c = _req("a"), _req("b"), _req("c")
    assert kv.allocate_slots(a, 8) and kv.allocate_slots(b, 8)
    assert (kv.state_slot("a"), kv.state_slot("b")) == (0, 1)
    assert not kv.can_hold_state(c) and not kv.allocate_slots(c, 8)
    assert kv.blocks_held(c) == 0  # refused whole: no blocks taken without a slot
    a.num_computed_tokens = 8
    assert kv.swap_out(a) is None  # states are not swapped: the request is recomputed
    kv.free(a)
    assert kv.state_slot("a") is None and kv.allocate_slots(c, 8) and kv.state_slot("c") == 0
    kv.free(b)
    kv.free(c)
    assert kv.state.num_used == 0 and kv.num_free_blocks == 16


def _run(sched: Scheduler, check=None, steps: int = 200) -> list:
    """Step until done, `check(out)` after each schedule (before its update)."""
    outs = []
    for _ in range(steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        if check is not None:
            check(out)
        outs.append(out)
        sched.update_after_step(out, {s.request_id: [7] for s in out.scheduled if s.samples})
    return outs


def test_the_scheduler_admits_no_request_without_a_free_slot() -> None:
    kv = KVCacheManager(64, 4, False, num_state_slots=2)
    sched = Scheduler(EngineConfig(max_num_batched_tokens=64, max_num_seqs=4), kv, 256)
    reqs = [_req(f"r{i}") for i in range(4)]
    for r in reqs:
        sched.add_request(r)

    def check(out) -> None:
        assert len(sched.running) <= 2 and out.scheduled
        for s in out.scheduled:  # every chunk names its request's slot
            assert s.state_slot == kv.state_slot(s.request_id) and s.state_slot in (0, 1)
        stats = sched.stats()
        assert stats.num_state_slots_total == 2 and stats.num_state_slots_used == len(sched.running)

    _run(sched, check)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert kv.state.num_used == 0


def test_abort_and_preemption_release_the_slot_and_recompute_starts_a_new_state() -> None:
    # 6 blocks of 4 tokens: two 8-token prompts growing to 20 tokens cannot both stay.
    kv = KVCacheManager(6, 4, False, num_state_slots=2)
    sched = Scheduler(EngineConfig(max_num_batched_tokens=64, max_num_seqs=2, preemption_mode="swap"), kv, 256)
    a, b = _req("a", max_tokens=12), _req("b", max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    outs = _run(sched)
    assert sched.num_preemptions > 0
    restarts = [s for out in outs for s in out.scheduled if s.start == 0]
    assert len(restarts) > 2  # a preempted request ran again from token 0 (recompute, not swap)
    assert all(out.swap_out == [] for out in outs)
    assert kv.state.num_used == 0
    c = _req("c", max_tokens=50)
    sched.add_request(c)
    sched.update_after_step(sched.schedule(), {"c": [7]})
    assert kv.state_slot("c") is not None
    sched.finish_request(c, RequestStatus.FINISHED_ABORTED)
    assert kv.state.num_used == 0 and kv.num_free_blocks == 6
