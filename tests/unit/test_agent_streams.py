"""What pdxfer's engine asks of the TransferAgent beyond the connector's reads, over real
NIXL on loopback: one registered arena, open streams, packed staging copies run once the
reads land, failure seen before a key settles, abandon and the settle check, deadlines."""

import itertools

import numpy as np
import pytest
import torch

from transfer.agent import PeerReads, TransferAgent
from transfer.agent.staging import (
    Packed,
    StagingArea,
    check_copies,
    copy_within,
    gather_to_staging,
)
from transfer.dataplane import RangeBatch, make_transport
from transfer.errors import InvalidInput, WrongState
from transfer.serving.ranks.spec import Copies

ARENA = 1 << 16
POLLS = 20000  # each poll returns at once; a loopback read lands in far fewer
_names = itertools.count()


@pytest.fixture
def pair():
    """A reader and a source agent, each with one arena; the source's is random."""
    n = next(_names)
    reader = TransferAgent(make_transport("nixl", f"stream-r{n}"))
    source = TransferAgent(make_transport("nixl", f"stream-s{n}"))
    mine = torch.zeros(ARENA, dtype=torch.uint8)
    theirs = torch.zeros(ARENA, dtype=torch.uint8).random_(
        0, 256, generator=torch.Generator().manual_seed(n)
    )
    reader.register_arena(mine)
    peer = reader.connect(source.register_arena(theirs))
    yield reader, peer, mine, theirs
    reader.close()
    source.close()


def _finish(agent: TransferAgent, key: str):
    for _ in range(POLLS):
        for finished in agent.poll():
            assert finished.key == key
            return finished
    raise AssertionError(f"{key} did not finish in {POLLS} polls")


def test_an_open_stream_finishes_only_once_sealed(pair):
    reader, peer, mine, theirs = pair
    reader.post("s", [PeerReads(peer, RangeBatch.single(0, 100, 512))], sealed=False)
    for _ in range(200):
        assert reader.poll() == []  # landed or not, an open key does not finish
    reader.extend("s", [PeerReads(peer, RangeBatch.single(4096, 9000, 256))], last=True)
    finished = _finish(reader, "s")
    assert finished.ok and (finished.nbytes, finished.descriptors) == (768, 2)
    assert torch.equal(mine[:512], theirs[100:612])
    assert torch.equal(mine[4096:4352], theirs[9000:9256])
    with pytest.raises(WrongState, match="not an open stream"):
        reader.extend("s", [], last=True)


def test_packed_copies_run_once_the_reads_landed(pair):
    """The source packs three cache ranges into its staging area; one read brings them into
    the reader's staging area, and the agent unpacks them to the reader's cache ranges."""
    reader, peer, mine, theirs = pair
    area = StagingArea(start=32768, end=ARENA, cache_end=32768)
    lengths = np.array([100, 7, 300], dtype=np.int64)
    cache_src = np.array([5000, 40, 20000], dtype=np.int64)
    packed = 33000 + np.concatenate(([0], np.cumsum(lengths)[:-1]))
    expected = [theirs[s : s + n].clone() for s, n in zip(cache_src, lengths, strict=True)]
    gather_to_staging(theirs, area, Copies(cache_src, packed, lengths))
    cache_dst = np.array([9000, 400, 1], dtype=np.int64)
    unpack = Copies(packed + 1000, cache_dst, lengths)
    check_copies(area, unpack, Packed.SRC)
    wire = RangeBatch.single(int(packed[0]) + 1000, int(packed[0]), int(lengths.sum()))
    reader.post("p", [PeerReads(peer, wire)], (unpack.src, unpack.dst, unpack.nbytes))
    assert _finish(reader, "p").ok
    for at, n, want in zip(cache_dst, lengths, expected, strict=True):
        assert torch.equal(mine[at : at + n], want)


def test_a_failed_open_key_shows_its_failure_and_abandon_settles_it(pair):
    reader, peer, _, _ = pair
    outside = RangeBatch.single(0, ARENA + 10, 8)  # beyond the source's arena
    reader.post("f", [PeerReads(peer, outside)], sealed=False)
    assert "past the remote arena" in reader.failure("f")
    assert reader.poll() == []  # open: it does not finish, failed or not
    assert reader.in_flight == 1
    assert reader.abandon("f") is True  # nothing of it can still land
    assert reader.in_flight == 0 and reader.failure("f") == ""
    assert reader.settled("f") is True


def test_a_strict_post_raises_and_past_its_deadline_nothing_is_posted(pair):
    reader, peer, _, _ = pair
    read = PeerReads("no-such-peer", RangeBatch.single(0, 0, 8))
    with pytest.raises(Exception, match="no-such-peer"):
        reader.post("x", [read], strict=True)
    assert "no-such-peer" in reader.failure("x")  # recorded before raising
    assert reader.abandon("x") is True
    reader.post("late", [], deadline_s=1e-9, sealed=False)
    with pytest.raises(InvalidInput, match="past its deadline"):
        reader.extend("late", [PeerReads(peer, RangeBatch.single(0, 0, 8))], last=True)
    assert reader.abandon("late") is True


@pytest.mark.parametrize(
    ("copies", "message"),
    [
        (Copies(np.array([0, 10]), np.array([32768, 32770]), np.array([4, 4])), "not back to back"),
        (Copies(np.array([0]), np.array([ARENA - 2]), np.array([4])), "outside staging"),
        (Copies(np.array([32760]), np.array([32768]), np.array([16])), "cache regions"),
        (Copies(np.array([0]), np.array([32768]), np.array([0])), "length must be >= 1"),
    ],
)
def test_bad_staging_copies_are_refused_naming_what_is_wrong(copies, message):
    area = StagingArea(start=32768, end=ARENA, cache_end=32768)
    with pytest.raises(InvalidInput, match=message):
        check_copies(area, copies, Packed.DST)


def test_copy_within_runs_each_packed_run_and_single_ranges():
    buffer = torch.arange(256, dtype=torch.int64).to(torch.uint8).repeat(8)
    before = buffer.clone()
    src = np.array([1024, 1030, 1100, 1500], dtype=np.int64)  # a run of two, then singles
    dst = np.array([10, 300, 50, 700], dtype=np.int64)
    nbytes = np.array([6, 20, 9, 3], dtype=np.int64)
    copy_within(buffer, src, dst, nbytes)
    for s, d, n in zip(src, dst, nbytes, strict=True):
        assert torch.equal(buffer[d : d + n], before[s : s + n])
    assert torch.equal(buffer[1024:], before[1024:])  # sources untouched
