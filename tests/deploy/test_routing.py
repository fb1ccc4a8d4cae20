"""Replica routing policies (tessera/deploy/routing.py): pure functions of prompts and loads."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.deploy.routing import (
    LeastLoaded, PrefixAware, PrefixAwareConfig, ReplicaLoad, RoundRobin, make_policy, prefix_hashes,
)


def loads(*values: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, v) for i, v in enumerate(values)]


def test_round_robin_cycles_and_least_loaded_takes_the_minimum():
    rr = RoundRobin()
    assert [rr.choose([1], loads(0, 0, 0)) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    ll = LeastLoaded()
    assert ll.choose([1], loads(3, 1, 2)) == 1
    assert sorted(ll.choose([1], loads(0, 0, 5)) for _ in range(2)) == [0, 1]  # ties spread


def test_prefix_hashes_are_chained_over_full_blocks():
    a = prefix_hashes(list(range(40)), 16, 64)
    assert len(a) == 2  # 40 tokens: two full blocks
    b = prefix_hashes(list(range(32)) + [99] * 8, 16, 64)
    assert a == b  # same two leading blocks
    c = prefix_hashes([7] + list(range(1, 40)), 16, 64)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later hash
    assert len(prefix_hashes(list(range(10_000)), 16, 8)) == 8
    assert prefix_hashes(list(range(15)), 16, 64) == []


def test_prefix_aware_keeps_a_conversation_on_its_replica():
    policy = PrefixAware(PrefixAwareConfig(block_size=4))
    system = list(range(100, 140))
    first = policy.choose(system + [1, 2, 3, 4], loads(0, 0, 0))
    # the same system prompt goes back to the same replica even when others are a little less loaded
    for turn in range(5):
        current = loads(*[2 if i == first else 1 for i in range(3)])
        assert policy.choose(system + [turn] * 8, current) == first
    other = policy.choose(list(range(500, 540)), loads(*[5 if i == first else 0 for i in range(3)]))
    assert other != first  # an unknown prompt goes to the least loaded


def test_prefix_aware_yields_to_load_past_both_thresholds():
    policy = PrefixAware(PrefixAwareConfig(block_size=4, balance_abs_threshold=4, balance_rel_threshold=1.5))
    prompt = list(range(64))
    assert policy.choose(prompt, loads(0, 0)) == 0
    assert policy.choose(prompt, loads(4, 0)) == 0  # gap 4: not past the absolute threshold
    assert policy.choose(prompt, loads(10, 7)) == 0  # gap 3
    assert policy.choose(prompt, loads(20, 15)) == 0  # gap 5 but 20 < 15 * 1.5
    assert policy.choose(prompt, loads(9, 2)) == 1  # both gaps exceeded: load wins...
    assert policy.choose(prompt, loads(0, 0)) == 1  # ...and the prefix now lives on replica 1


def test_prefix_aware_forgets_a_removed_replica_and_bounds_its_table():
    policy = PrefixAware(PrefixAwareConfig(block_size=2, capacity=10))
    prompt = list(range(12))
    assert policy.choose(prompt, loads(0, 5)) == 0
    policy.forget(0)
    assert policy.choose(prompt, [ReplicaLoad(1, 5), ReplicaLoad(2, 0)]) == 2
    for i in range(50):
        policy.choose([i] * 8, loads(0, 0))
    assert len(policy._owner) <= 10


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["round-robin", "least-loaded", "prefix-aware"]),
       st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=0, max_size=40),
                          st.lists(st.integers(0, 50), min_size=1, max_size=5)), min_size=1, max_size=30))
def test_every_policy_picks_a_replica_in_rotation(name, requests):
    policy = make_policy(name, block_size=4)
    for tokens, values in requests:
        rotation = [ReplicaLoad(i * 3, v) for i, v in enumerate(values)]  # ids need not be 0..n-1
        chosen = policy.choose(tokens, rotation)
        assert chosen in {r.replica_id for r in rotation}
        if name == "least-loaded":
            assert dict((r.replica_id, r.load) for r in rotation)[chosen] == min(values)


def test_unknown_policy_and_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="unknown router policy"):
        make_policy("random")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PrefixAwareConfig(balance_rel_threshold=0.5)
