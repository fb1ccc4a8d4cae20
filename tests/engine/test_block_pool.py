"""Block hand-out order: warm blocks first, so the KV cache's resident pages follow its use."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.engine.core.block_pool import BlockPool


def test_a_freed_unhashed_block_is_handed_out_again_before_an_untouched_one():
    pool = BlockPool(8, enable_caching=True)
    a, b = pool.allocate(2)
    pool.free([a, b])
    again = pool.allocate(2)
    assert {blk.block_id for blk in again} == {a.block_id, b.block_id}
    assert pool.num_touched_blocks == 2


def test_untouched_blocks_go_before_cached_ones_are_evicted():
    pool = BlockPool(4, enable_caching=True)
    (a,) = pool.allocate(1)
    pool.register(a, 123)
    pool.free([a])
    assert pool.num_free_blocks == 4
    fresh = pool.allocate(3)  # three never-used blocks, the cached one kept
    assert a.block_id not in {blk.block_id for blk in fresh}
    assert pool.lookup(123) is a
    (last,) = pool.allocate(1)  # nothing untouched left: now it is evicted
    assert last is a and pool.lookup(123) is None and a.block_hash is None
    assert pool.num_touched_blocks == 4


def test_untouched_blocks_are_handed_out_lowest_id_first():
    pool = BlockPool(6, enable_caching=False)
    assert [blk.block_id for blk in pool.allocate(3)] == [0, 1, 2]


def test_a_prefix_hit_on_a_free_cached_block_takes_it_off_the_free_list():
    pool = BlockPool(3, enable_caching=True)
    (a,) = pool.allocate(1)
    pool.register(a, 7)
    pool.free([a])
    pool.touch([pool.lookup(7)])
    assert not pool.is_free(a.block_id) and pool.num_free_blocks == 2
    assert a.block_id not in {blk.block_id for blk in pool.allocate(2)}


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "register", "hit"]), st.integers(0, 5)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops, st.booleans())
def test_touched_blocks_never_exceed_the_peak_of_blocks_held_or_cached(steps, caching):
    """The resident-memory promise: a block is first used only when every used block is held
    or still findable in the prefix cache, so the touched count is the peak of those."""
    pool = BlockPool(12, enable_caching=caching)
    held: list = []
    next_hash = 0
    peak = 0
    for op, n in steps:
        if op == "alloc" and n <= pool.num_free_blocks:
            held += pool.allocate(n)
        elif op == "free" and held:
            k = min(n, len(held))
            pool.free(held[:k])
            held = held[k:]
        elif op == "register" and held:
            next_hash += 1
            pool.register(held[n % len(held)], next_hash)
        elif op == "hit" and pool.cached:
            block = list(pool.cached.values())[n % len(pool.cached)]
            pool.touch([block])
            held.append(block)
        live = {b.block_id for b in held} | {b.block_id for b in pool.cached.values()}
        peak = max(peak, len(live))
        assert pool.num_touched_blocks <= peak
        assert pool.num_free_blocks == pool.num_blocks - len({b.block_id for b in held})
        assert all(pool.is_free(i) for i in pool.untouched)
        assert len({*pool.untouched, *pool.recycled, *pool.free_queue}) == pool.num_free_blocks
