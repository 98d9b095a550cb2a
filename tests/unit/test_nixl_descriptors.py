"""The NIXL backend's descriptor arithmetic, without NIXL: granule sizes, the index lists
that name a batch's granules, and when the prepared lists serve a batch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.dataplane.nixl_descriptors import (
    MAX_GRANULES_PER_RANGE,
    MAX_PREPPED_DESCRIPTORS,
    MIN_GRANULE,
    auto_granule,
    descriptors,
    granule_descriptors,
    granule_indices,
    is_granule_option,
    serves_prepped,
)
from transfer.dataplane.ranges import RangeBatch

GRANULES = st.sampled_from([4096, 8192, 65536])


@given(st.integers(min_value=0, max_value=1 << 44))
def test_auto_granule_is_the_smallest_that_fits(arena_bytes):
    granule = auto_granule(arena_bytes)
    assert granule >= MIN_GRANULE and granule & (granule - 1) == 0
    assert arena_bytes // granule <= MAX_PREPPED_DESCRIPTORS
    if granule > MIN_GRANULE:
        assert arena_bytes // (granule // 2) > MAX_PREPPED_DESCRIPTORS


@pytest.mark.parametrize(
    ("option", "ok"),
    [("auto", True), (0, True), (4096, True), (1 << 20, True), (2048, False),
     (4097, False), (12288, False), (-4096, False), ("4096", False), (True, False),
     (False, False), (None, False)],
)  # fmt: skip
def test_granule_options(option, ok):
    assert is_granule_option(option) is ok


@settings(max_examples=200)
@given(
    GRANULES, st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 5)), min_size=1, max_size=20)
)
def test_indices_name_each_ranges_granules_in_order(granule, runs):
    offsets = np.array([first * granule for first, _ in runs], dtype=np.int64)
    counts = np.array([count for _, count in runs], dtype=np.int64)
    indices = granule_indices(offsets, counts, int(counts.sum()), granule)
    expected = np.concatenate([np.arange(first, first + count) for first, count in runs])
    assert indices.dtype == np.int32
    np.testing.assert_array_equal(indices, expected)


def test_descriptors_are_addresses_lengths_and_device():
    descs = descriptors(1 << 40, np.array([0, 4096]), np.array([4096, 100]), 3)
    assert descs.dtype == np.uint64
    np.testing.assert_array_equal(descs, [[1 << 40, 4096, 3], [(1 << 40) + 4096, 100, 3]])
    whole = granule_descriptors(8192, 3 * 4096 + 5, 4096, 0)  # the tail is no granule
    np.testing.assert_array_equal(whole[:, 0], [8192, 12288, 16384])
    assert (whole[:, 1] == 4096).all()


@settings(max_examples=300)
@given(
    GRANULES,
    st.integers(1, 64),
    st.integers(1, 64),
    st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70), st.integers(1, 4), st.booleans()),
             min_size=1, max_size=12),
)  # fmt: skip
def test_prepped_lists_serve_only_whole_granules_inside_both_arenas(
    granule, local_granules, remote_granules, rows
):
    local_bytes, remote_bytes = local_granules * granule + 17, remote_granules * granule
    ranges = RangeBatch.of(
        (local * granule, remote * granule, count * granule - (0 if whole else 512))
        for local, remote, count, whole in rows
    )
    served = serves_prepped(granule, local_bytes, remote_bytes, ranges)
    aligned = all(whole for *_, whole in rows)
    inside = all(
        (local + count) <= local_granules and (remote + count) <= remote_granules
        for local, remote, count, _ in rows
    )
    few = sum(count for _, _, count, _ in rows) <= MAX_GRANULES_PER_RANGE * len(rows)
    assert served == (aligned and inside and few)


def test_no_prepped_lists_without_a_granule_or_below_one():
    ranges = RangeBatch.of([(0, 0, 4096)])
    assert serves_prepped(4096, 8192, 8192, ranges)
    assert not serves_prepped(0, 8192, 8192, ranges)
    assert not serves_prepped(4096, 8192, 4095, ranges)
    assert not serves_prepped(4096, 4095, 8192, ranges)
