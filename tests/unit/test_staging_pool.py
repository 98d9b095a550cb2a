"""StagingPool: page-aligned, non-overlapping extents of a staging area, coalesced on free.

A rule-based machine drives random allocate/free sequences against a page-level model:
held extents never overlap and stay inside the pool, the byte accounting always adds up,
`allocate` fails exactly when the model's longest free run is too short, and freeing
everything leaves one run spanning the whole pool.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from transfer.cache.staging_pool import PAGE_BYTES, StagingPool
from transfer.errors import InvalidInput, WrongState


def _longest_run(free: list[bool]) -> int:
    best = run = 0
    for is_free in free:
        run = run + 1 if is_free else 0
        best = max(best, run)
    return best


class PoolMachine(RuleBasedStateMachine):
    keys = Bundle("keys")

    @initialize(
        page_bytes=st.sampled_from([1, 3, 64, 4096]),
        reserved_pages=st.integers(0, 3),
        reserved_slack=st.integers(0, 1),
        num_pages=st.integers(0, 24),
        tail=st.integers(0, 1),
    )
    def make_pool(self, page_bytes, reserved_pages, reserved_slack, num_pages, tail):
        # reserved_slack: a reserve that is not a whole number of pages rounds up.
        slack = reserved_slack if reserved_pages and page_bytes > 1 else 0
        reserved = reserved_pages * page_bytes - slack
        base = reserved_pages * page_bytes
        # tail: a partial page at the end of the area is never handed out.
        area = base + num_pages * page_bytes + (tail * (page_bytes - 1))
        self.pool = StagingPool(area, reserved, page_bytes)
        assert self.pool.base == base
        assert self.pool.capacity_bytes == num_pages * page_bytes
        self.page = page_bytes
        self.free_pages = [True] * num_pages  # the model
        self.held: dict[str, tuple[int, int]] = {}  # key -> (offset, pages)
        self.next_key = 0

    def _pages(self, nbytes: int) -> int:
        return -(-nbytes // self.page)

    @rule(target=keys, size=st.integers(1, 10), extra=st.integers(0, 2))
    def allocate(self, size, extra):
        # sizes around page boundaries: whole pages, one byte short, one byte over.
        nbytes = max(1, size * self.page - 1 + extra)
        key = f"k{self.next_key}"
        self.next_key += 1
        pages = self._pages(nbytes)
        largest_before = self.pool.largest_free_bytes
        assert largest_before == _longest_run(self.free_pages) * self.page
        offset = self.pool.allocate(key, nbytes)
        if largest_before < pages * self.page:
            assert offset is None
            assert not self.pool.holds(key)
            return key  # a key that holds nothing: freeing it must answer False
        assert offset is not None
        assert (offset - self.pool.base) % self.page == 0
        first = (offset - self.pool.base) // self.page
        assert first >= 0 and first + pages <= len(self.free_pages)
        for p in range(first, first + pages):
            assert self.free_pages[p], f"page {p} handed out twice"
            self.free_pages[p] = False
        self.held[key] = (offset, pages)
        assert self.pool.holds(key)
        return key

    @rule(key=consumes(keys))
    def free(self, key):
        was_held = key in self.held
        assert self.pool.free(key) is was_held
        if was_held:
            offset, pages = self.held.pop(key)
            first = (offset - self.pool.base) // self.page
            for p in range(first, first + pages):
                self.free_pages[p] = True
        assert not self.pool.holds(key)
        assert self.pool.free(key) is False  # a second free finds nothing

    @precondition(lambda self: hasattr(self, "held") and self.held)
    @rule(key=keys)
    def allocate_again_under_a_held_key(self, key):
        if key not in self.held:
            return
        free_before = self.pool.free_bytes
        with pytest.raises(WrongState):
            self.pool.allocate(key, 1)
        assert self.pool.free_bytes == free_before
        assert self.pool.holds(key)

    @rule()
    def free_everything(self):
        for key in list(self.held):
            assert self.pool.free(key)
        self.held.clear()
        self.free_pages = [True] * len(self.free_pages)
        assert self.pool.free_bytes == self.pool.capacity_bytes
        assert self.pool.largest_free_bytes == self.pool.capacity_bytes

    @invariant()
    def extents_are_disjoint_aligned_and_inside(self):
        if not hasattr(self, "pool"):
            return
        pool, end = self.pool, self.pool.base + self.pool.capacity_bytes
        spans = sorted((offset, offset + pages * self.page) for offset, pages in self.held.values())
        for start, stop in spans:
            assert pool.base <= start < stop <= end
            assert start % self.page == 0
        for (_, stop), (start, _) in zip(spans, spans[1:], strict=False):
            assert stop <= start, "held extents overlap"

    @invariant()
    def bytes_add_up(self):
        if not hasattr(self, "pool"):
            return
        held = sum(pages for _, pages in self.held.values()) * self.page
        assert self.pool.free_bytes + held == self.pool.capacity_bytes
        assert self.pool.free_bytes == sum(self.free_pages) * self.page
        # Coalescing: the pool's longest run is the model's, so frees always merge.
        assert self.pool.largest_free_bytes == _longest_run(self.free_pages) * self.page
        if not self.held:
            assert self.pool.largest_free_bytes == self.pool.capacity_bytes


PoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolMachine = PoolMachine.TestCase


def test_frees_in_any_order_coalesce_into_one_extent():
    pool = StagingPool(10 * 64, 0, 64)
    offsets = [pool.allocate(i, 64) for i in range(10)]
    assert sorted(offsets) == [i * 64 for i in range(10)]
    assert pool.allocate("full", 1) is None
    for i in (3, 5, 4, 0, 9, 1, 8, 2, 7, 6):
        assert pool.free(i)
    assert pool.largest_free_bytes == pool.capacity_bytes == 640
    assert pool.allocate("all", 640) == 0


def test_an_extent_is_contiguous_even_when_enough_pages_are_free():
    pool = StagingPool(4 * 64, 0, 64)
    for key in "abcd":
        pool.allocate(key, 64)
    pool.free("a")
    pool.free("c")
    assert pool.free_bytes == 128 and pool.largest_free_bytes == 64
    assert pool.allocate("two pages", 65) is None  # two free pages, but not adjacent
    assert not pool.holds("two pages")
    assert pool.allocate("one page", 64) in (0, 128)


@pytest.mark.parametrize(
    ("area", "reserved", "page", "base", "capacity"),
    [
        (10_000, 0, 64, 0, (10_000 // 64) * 64),
        (10_000, 100, 64, 128, ((10_000 - 128) // 64) * 64),
        (10_000, 128, 64, 128, ((10_000 - 128) // 64) * 64),
        (4096 + (1 << 20), 4096, PAGE_BYTES, 4096, 1 << 20),
        (4096 + (1 << 20), 1, PAGE_BYTES, 4096, 1 << 20),
        (100, 10, 1, 10, 90),
    ],
)
def test_reserved_bytes_round_the_base_up_to_a_page(area, reserved, page, base, capacity):
    pool = StagingPool(area, reserved, page)
    assert pool.base == base and pool.page_bytes == page
    assert pool.capacity_bytes == capacity
    assert pool.free_bytes == pool.largest_free_bytes == capacity
    offset = pool.allocate("r", 1)
    assert offset == base  # the reserved bytes are never handed out
    assert offset >= reserved


@pytest.mark.parametrize(
    ("area", "reserved", "page"),
    [(100, 4096, PAGE_BYTES), (4000, 100, PAGE_BYTES), (0, 0, 64), (63, 0, 64), (4096, 4096, 4096)],
)
def test_an_area_without_a_whole_page_past_the_reserve_has_no_capacity(area, reserved, page):
    pool = StagingPool(area, reserved, page)
    assert pool.capacity_bytes == pool.free_bytes == pool.largest_free_bytes == 0
    assert pool.allocate("r", 1) is None
    assert not pool.holds("r")
    assert pool.free("r") is False


def test_the_default_page_is_4_kib_and_sizes_round_up_to_pages():
    pool = StagingPool(3 * PAGE_BYTES)
    assert pool.page_bytes == PAGE_BYTES == 4096
    assert pool.allocate("a", 1) == 0
    assert pool.free_bytes == 2 * PAGE_BYTES  # one byte takes a whole page
    assert pool.allocate("b", PAGE_BYTES + 1) == PAGE_BYTES
    assert pool.free_bytes == 0
    assert pool.allocate("c", 1) is None


def test_the_same_key_cannot_hold_two_extents():
    pool = StagingPool(8 * 64, 0, 64)
    first = pool.allocate("r", 64)
    with pytest.raises(WrongState, match="'r'"):
        pool.allocate("r", 64)
    assert pool.free_bytes == 7 * 64  # the failed call took nothing
    assert pool.free("r") is True
    assert pool.allocate("r", 64) == first  # free again: the key may allocate anew


def test_keys_are_any_hashable_and_unknown_keys_free_nothing():
    pool = StagingPool(8 * 64, 0, 64)
    assert pool.free("nobody") is False
    assert pool.allocate(("req", 1), 100) is not None
    assert pool.holds(("req", 1)) and not pool.holds(("req", 2))
    assert pool.free(("req", 2)) is False
    assert pool.free_bytes == 6 * 64
    assert pool.free(("req", 1)) is True
    assert pool.free(("req", 1)) is False
    assert pool.free_bytes == pool.capacity_bytes


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"area_bytes": -1}, "area_bytes"),
        ({"area_bytes": 1.5}, "area_bytes"),
        ({"area_bytes": True}, "area_bytes"),
        ({"area_bytes": "4096"}, "area_bytes"),
        ({"area_bytes": 4096, "reserved_bytes": -1}, "reserved_bytes"),
        ({"area_bytes": 4096, "reserved_bytes": False}, "reserved_bytes"),
        ({"area_bytes": 4096, "page_bytes": 0}, "page_bytes"),
        ({"area_bytes": 4096, "page_bytes": -4096}, "page_bytes"),
        ({"area_bytes": 4096, "page_bytes": 64.0}, "page_bytes"),
    ],
)
def test_bad_constructor_arguments_name_the_field(kwargs, field):
    with pytest.raises(InvalidInput, match=field):
        StagingPool(**kwargs)


@pytest.mark.parametrize("nbytes", [0, -1, -4096])
def test_allocating_less_than_one_byte_is_invalid(nbytes):
    pool = StagingPool(8 * 64, 0, 64)
    with pytest.raises(InvalidInput, match="nbytes"):
        pool.allocate("r", nbytes)
    assert not pool.holds("r")
    assert pool.free_bytes == pool.capacity_bytes


@pytest.mark.parametrize("nbytes", [1.5, "64", True, None])
def test_a_size_that_is_not_an_integer_is_refused_and_changes_nothing(nbytes):
    pool = StagingPool(256, 0, 64)
    with pytest.raises(InvalidInput, match="nbytes"):
        pool.allocate("k", nbytes)
    assert not pool.holds("k")
    assert pool.free_bytes == pool.largest_free_bytes == pool.capacity_bytes == 256
    assert pool.allocate("k", 256) == 0
