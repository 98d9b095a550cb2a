import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.dataplane import pattern
from transfer.dataplane import RangeBatch
from transfer.dataplane.metadata import PeerInfo


def test_columns_become_read_only_int64():
    batch = RangeBatch([0, 10], np.array([5, 7], dtype=np.uint32), (3, 4))
    for column in (batch.local, batch.remote, batch.nbytes):
        assert column.dtype == np.int64 and not column.flags.writeable
    assert len(batch) == 2 and batch.total_bytes == 7
    assert RangeBatch.of([(0, 5, 3), (10, 7, 4)]).remote.tolist() == [5, 7]


def test_offsets_above_2_gib_keep_their_value():
    big = 2**31 + 12345
    batch = RangeBatch.single(big, 2**40, 2**31)
    assert int(batch.local[0]) == big and int(batch.remote[0]) == 2**40
    batch.check_within(big + 2**31, 2**40 + 2**31)
    with pytest.raises(ValueError, match=r"ranges\.local\[0\]"):
        batch.check_within(big + 2**31 - 1, 2**41)


@pytest.mark.parametrize(
    ("local", "remote", "nbytes", "field"),
    [
        ([0, 1], [0], [1, 1], "differ in length"),
        ([-1], [0], [1], r"ranges\.local"),
        ([0], [-5], [1], r"ranges\.remote"),
        ([0], [0], [0], r"ranges\.nbytes"),
        ([0.5], [0], [1], r"ranges\.local"),
        ([[0]], [0], [1], r"ranges\.local"),
        ([], [], [], "empty"),
        ([2**63 - 1], [0], [1], "overflows"),
    ],
)
def test_bad_columns_name_the_field(local, remote, nbytes, field):
    with pytest.raises(ValueError, match=field):
        RangeBatch(local, remote, nbytes)


def test_check_within_names_the_side_and_range():
    batch = RangeBatch.of([(0, 0, 10), (20, 90, 20)])
    with pytest.raises(ValueError, match=r"ranges\.remote\[1\].*110.*100"):
        batch.check_within(100, 100)
    batch.check_within(40, 110)


def test_swapped_exchanges_sides():
    batch = RangeBatch.of([(1, 2, 3)]).swapped()
    assert (batch.local[0], batch.remote[0], batch.nbytes[0]) == (2, 1, 3)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 50), st.booleans(), st.booleans()), min_size=1, max_size=40)
)
def test_coalesced_moves_the_same_bytes(pieces):
    """Each piece either continues its predecessor on both sides or jumps; coalescing must
    keep the byte map (local byte -> remote byte) identical and merge every continuation."""
    local, remote, nbytes = [], [], []
    lpos = rpos = 1000
    for size, jump_local, jump_remote in pieces:
        lpos += 7 * jump_local
        rpos += 11 * jump_remote
        local.append(lpos)
        remote.append(rpos)
        nbytes.append(size)
        lpos += size
        rpos += size
    batch = RangeBatch(local, remote, nbytes)
    merged = batch.coalesced()

    def byte_map(b):
        return [
            (lo + k, ro + k)
            for lo, ro, n in zip(b.local, b.remote, b.nbytes, strict=True)
            for k in range(n)
        ]

    assert byte_map(merged) == byte_map(batch)
    continuing = sum(1 for _, jl, jr in pieces[1:] if not jl and not jr)
    assert len(merged) == len(batch) - continuing


def test_pattern_is_a_function_of_the_absolute_offset():
    whole = pattern(7, 0, 10_000)
    for start, n in [(0, 1), (3, 17), (8, 64), (4095, 3000), (9_999, 1)]:
        assert np.array_equal(pattern(7, start, n), whole[start : start + n])
    assert not np.array_equal(pattern(7, 0, 64), pattern(8, 0, 64))
    assert not np.array_equal(pattern(7, 0, 64), pattern(7, 64, 64))


def test_metadata_round_trip_and_rejects_garbage():
    info = PeerInfo("nixl", "p0", 1 << 33, "cpu", 0, 0x7F0000000000, b"\x00payload\xff")
    assert PeerInfo.decode(info.encode()) == info
    for bad in (b"", b"nonsense", info.encode()[:12], info.encode()[: -len(b"payload\xff") - 40]):
        with pytest.raises(ValueError, match="metadata"):
            PeerInfo.decode(bad)
    with pytest.raises(ValueError, match="metadata"):
        PeerInfo.decode("text")
