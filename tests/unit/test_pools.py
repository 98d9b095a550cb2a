"""Block and slot pools: both block policies, refcounts, tables, all-or-nothing, thread safety."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.cache import BlockPool, CacheFullError, CachePools, SlotPool, fragment
from transfer.cache.extents import count_runs
from transfer.errors import CapacityError, NotFound
from transfer.memplan import plan_memory
from transfer.presets import get_preset


def _state(pool: BlockPool) -> tuple:
    return pool.num_free, [pool.refcount(i) for i in range(pool.num_total)]


def test_fresh_pool_hands_out_contiguous_lowest_ids_and_reuses_holes_first():
    pool = BlockPool(10, policy="lowest")
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.free([1, 3])
    assert pool.allocate(3) == [1, 3, 5]
    assert pool.num_free == 4 and pool.can_allocate(4) and not pool.can_allocate(5)


def test_allocation_is_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate(3, request_id="a")
    before = _state(pool)
    with pytest.raises(CacheFullError, match="cannot allocate 2 blocks: 1 of 4 free") as info:
        pool.allocate(2, request_id="b")
    assert isinstance(info.value, CapacityError) and not isinstance(info.value, ValueError)
    assert _state(pool) == before
    with pytest.raises(NotFound, match="no block table"):
        pool.block_table("b")


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([0, 9], "block id 9 out of range"),
        ([0, 3], "block 3 is not allocated"),
        ([0, 0], "duplicate"),
    ],
)
def test_bad_frees_change_nothing(ids, message):
    pool = BlockPool(4)
    pool.allocate(2)
    before = _state(pool)
    with pytest.raises(ValueError, match=message):
        pool.free(ids)
    assert _state(pool) == before


def test_refcounts_free_a_shared_block_only_at_zero():
    pool = BlockPool(4)
    ids = pool.allocate(2, request_id="a")
    pool.incref(ids, request_id="b")
    assert pool.refcount(ids[0]) == 2 and pool.block_table("b") == tuple(ids)
    assert pool.free_request("a") == []
    assert pool.free_request("b") == ids
    assert pool.num_free == 4


def test_slot_pool_gives_each_request_adjacent_spec_slots():
    pool = SlotPool(6, spec_slots_per_request=2)
    assert pool.allocate("a") == [0, 1, 2]
    assert pool.allocate("b") == [3, 4, 5]
    with pytest.raises(CacheFullError):
        pool.allocate("c")
    with pytest.raises(ValueError, match="not one request's 3 adjacent slots"):
        pool.free([3, 4])
    pool.free_request("a")
    assert pool.num_free == 3 and pool.slots("b") == (3, 4, 5)
    with pytest.raises(ValueError, match="not a multiple"):
        SlotPool(7, spec_slots_per_request=1)


def test_cache_pools_allocate_blocks_and_slots_atomically():
    plan = plan_memory(get_preset("tiny-qwen3-next"), 1, 2**22, 2, spec_tokens=1)
    pools = CachePools.from_plan(plan, spec_slots_per_request=1)
    first = pools.allocate("a", 3 * plan.block_size)
    assert first.block_ids == (0, 1, 2) and first.slot_ids == (0, 1)
    pools.allocate("b", 1)
    free_blocks = pools.blocks.num_free
    with pytest.raises(CacheFullError, match="no free state slot"):
        pools.allocate("c", 1)  # blocks are free, slots are not: nothing changes
    assert pools.blocks.num_free == free_blocks and pools.num_requests == 2
    assert pools.get("a") == first
    pools.free("a")
    pools.free("b")
    assert (
        pools.blocks.num_free == plan.num_kv_blocks and pools.slots.num_free == plan.num_state_slots
    )
    with pytest.raises(ValueError, match="num_tokens must be"):
        pools.allocate("d", 0)


def test_fragment_leaves_holes_that_new_requests_land_in():
    pool = BlockPool(64, policy="lowest")
    held = fragment(pool, random.Random(3))
    ids = pool.allocate(6)
    assert ids != list(range(ids[0], ids[0] + 6))  # not one contiguous run
    for allocation in held:
        pool.free(allocation)
    pool.free(ids)
    assert pool.num_free == 64


def test_contiguous_pool_serves_the_same_request_from_one_run():
    pool = BlockPool(64)
    held = fragment(pool, random.Random(3))
    ids = pool.allocate(6, request_id="r")
    assert ids == list(range(ids[0], ids[0] + 6)) and pool.runs("r") == 1
    assert pool.allocate(1) != [ids[0] - 1]  # a one-block request takes a one-block hole
    for allocation in held:
        pool.free(allocation)


def test_contiguous_pool_keeps_its_contract():
    pool = BlockPool(10)
    assert pool.allocate(3, "a") == [0, 1, 2]
    pool.allocate(2, "b")
    pool.free_request("a")
    assert pool.allocate(2, "a") == [0, 1]  # the best-fitting hole, not the tail
    pool.incref([0, 1], "c")
    pool.free_request("b")
    assert pool.free_request("a") == [] and pool.refcount(0) == 1
    assert pool.block_table("c") == (0, 1) and pool.runs("c") == 1
    assert pool.allocate(8, "d") == list(range(2, 10))  # coalesced: one run
    with pytest.raises(CacheFullError, match="0 of 10 free"):
        pool.allocate(1)
    with pytest.raises(ValueError, match="policy must be one of"):
        BlockPool(4, policy="first")


# (allocate n blocks) or (free the i-th live request), the same history for both policies
_history = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 24)),
        st.tuples(st.just("free"), st.integers(0, 1000)),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 160), history=_history)
def test_policies_on_the_same_history(size, history):
    """Both pools replay one history of requests; every allocation is checked against the
    contiguous pool's own free set: no double allocation, free total conserved, all or
    nothing, and never more runs than lowest-first would hand out from that free set."""
    pools = {policy: BlockPool(size, policy) for policy in ("contiguous", "lowest")}
    live: dict[str, list[list[int]]] = {policy: [] for policy in pools}
    for step, (op, arg) in enumerate(history):
        if op == "free":
            if live["lowest"]:
                i = arg % len(live["lowest"])
                for policy, pool in pools.items():
                    pool.free(live[policy].pop(i))
            continue
        if arg > pools["lowest"].num_free:
            for pool in pools.values():
                before = _state(pool)
                with pytest.raises(CacheFullError):
                    pool.allocate(arg, request_id=step)
                assert _state(pool) == before
            continue
        pool = pools["contiguous"]
        free = {i for i in range(size) if pool.refcount(i) == 0}
        ids = pool.allocate(arg, request_id=step)
        assert len(set(ids)) == arg and set(ids) <= free  # no double allocation
        assert pool.runs(step) == count_runs(sorted(ids))
        assert count_runs(sorted(ids)) <= count_runs(sorted(free)[:arg])
        live["contiguous"].append(ids)
        live["lowest"].append(pools["lowest"].allocate(arg))
        for p in pools.values():
            held = sum(1 for i in range(size) if p.refcount(i))
            assert p.num_free == size - held  # free total conserved


def test_concurrent_allocate_and_free_never_hand_out_a_block_twice():
    pool = BlockPool(200)
    owned: set[int] = set()
    guard = threading.Lock()
    errors = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine = []
        for _ in range(300):
            if mine and rng.random() < 0.5:
                ids = mine.pop(rng.randrange(len(mine)))
                with guard:
                    owned.difference_update(ids)
                pool.free(ids)
                continue
            try:
                ids = pool.allocate(rng.randint(1, 5))
            except CacheFullError:
                continue
            with guard:
                if owned & set(ids):
                    errors.append(ids)
                owned.update(ids)
            mine.append(ids)
        for ids in mine:
            with guard:
                owned.difference_update(ids)
            pool.free(ids)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert errors == [] and pool.num_free == 200
