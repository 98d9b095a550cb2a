"""FreeExtents: the contiguity-aware free list behind the KV block pool."""

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.cache.extents import FreeExtents, count_runs
from transfer.errors import InvalidInput


def lowest_first(free: set[int], n: int) -> list[int]:
    """The old allocator's choice on the same free set: the n lowest free ids."""
    return heapq.nsmallest(n, free)


def min_runs(free: set[int], n: int) -> int:
    """The fewest runs any allocator could hand out: the k largest runs that hold n."""
    lengths = sorted((length for _, length in extents_with_free(free).runs()), reverse=True)
    total = 0
    for k, length in enumerate(lengths, 1):
        total += length
        if total >= n:
            return k
    raise AssertionError("n exceeds the free total")


def extents_with_free(free: set[int]) -> FreeExtents:
    size = max(free, default=-1) + 1
    extents = FreeExtents(size)
    extents.take(size)
    extents.put(free)
    return extents


# (allocate n) or (free the i-th live request), over a pool of up to 200 blocks
operations = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 40)),
        st.tuples(st.just("free"), st.integers(0, 1000)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(size=st.integers(0, 200), ops=operations)
def test_history_keeps_every_invariant(size, ops):
    extents = FreeExtents(size)
    live: list[list[int]] = []
    held: set[int] = set()
    for op, arg in ops:
        if op == "alloc":
            free = set(range(size)) - held
            if arg > len(free):
                before = extents.runs()
                with pytest.raises(InvalidInput):
                    extents.take(arg)
                assert extents.runs() == before  # all or nothing
                continue
            best = min_runs(free, arg) if arg else 0
            old_runs = count_runs(lowest_first(free, arg))
            ids = extents.take(arg)
            assert len(ids) == arg
            assert not held & set(ids), "double allocation"
            assert set(ids) <= free
            assert count_runs(sorted(ids)) == best  # the fewest runs possible
            assert count_runs(sorted(ids)) <= old_runs  # never worse than lowest-first
            held |= set(ids)
            live.append(ids)
        elif live:
            ids = live.pop(arg % len(live))
            extents.put(ids)
            held -= set(ids)
        assert extents.num_free == size - len(held)  # the free total is conserved
        runs = extents.runs()
        covered = {i for start, length in runs for i in range(start, start + length)}
        assert covered == set(range(size)) - held
        # coalescing is complete: no two runs touch
        assert all(a + n < b for (a, n), (b, _) in zip(runs, runs[1:], strict=False))


def test_small_request_takes_the_best_fitting_hole():
    extents = extents_with_free({0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 20, 21, 22})
    assert extents.take(2) == [10, 11]
    assert extents.take(3) == [20, 21, 22]
    assert extents.runs() == [(0, 8)]


def test_large_request_takes_the_largest_runs_first():
    extents = extents_with_free({0, 1, 5, 6, 7, 8, 9, 20, 21, 22})
    ids = extents.take(9)
    assert ids[:5] == [5, 6, 7, 8, 9] and ids[5:8] == [20, 21, 22]
    assert count_runs(sorted(ids)) == 3
    assert extents.num_free == 1


def test_one_million_blocks_in_few_extents():
    extents = FreeExtents(1 << 20)
    tables = [extents.take(1000) for _ in range(500)]
    for table in tables[::2]:
        extents.put(table)
    assert extents.num_runs == 251  # 250 holes and the tail
    assert count_runs(extents.take(2500)) == 1  # the tail, not three holes


def test_count_runs_follows_table_order():
    assert count_runs([]) == 0
    assert count_runs([3, 4, 5, 9, 10, 0]) == 3


def test_a_negative_count_is_refused_and_changes_nothing():
    extents = extents_with_free({2, 3, 7})
    with pytest.raises(InvalidInput, match="-1 ids requested"):
        extents.take(-1)
    assert extents.runs() == [(2, 2), (7, 1)] and extents.num_free == 3
