"""Two real processes, each with an arena: metadata exchange, READ and WRITE of large and
small random ranges, byte checks, notifications, and offsets above 2^31."""

import time

import numpy as np
import pytest
import torch

from tests.support.dataplane import PeerProcess, digest, expect_pattern, random_ranges
from transfer.dataplane import Op, RangeBatch, make_transport, wait
from transfer.dataplane.metadata import PeerInfo

pytestmark = pytest.mark.slow

SEED = 2024
MIB = 1 << 20
HIGH = 1 << 31  # offsets at and above 2^31
ARENA = HIGH + 16 * MIB  # pages are committed only where the tests write
READ_REGION = (0, 68 * MIB)  # of the peer's arena: keeps the pattern
WRITE_REGION = (68 * MIB, 136 * MIB)
TOP_READ = (HIGH, HIGH + 8 * MIB)
TOP_WRITE = (HIGH + 8 * MIB, ARENA)
DEADLINE_S = 60.0


@pytest.fixture(scope="module", params=["nixl", "ucx"])
def link(request):
    """(transport, peer process, local arena), connected both ways."""
    backend = request.param
    peer = PeerProcess(
        backend, f"peer-{backend}", ARENA, [(0, WRITE_REGION[1]), (HIGH, ARENA)], SEED
    )
    transport = make_transport(backend, f"test-{backend}")
    arena = torch.empty(ARENA, dtype=torch.uint8)
    try:
        meta = transport.register(arena)
        assert transport.add_peer(peer.metadata) == peer.name
        assert peer.call("add_peer", meta) == transport.name
        yield transport, peer, arena
    finally:
        transport.close()
        peer.stop()


def _run(transport, op, peer, ranges, notif=b""):
    status = wait(transport, transport.post(op, peer.name, ranges, notif, deadline_s=DEADLINE_S))
    assert status.done, status.reason


def _peer_holds(peer, arena, ranges):
    assert peer.call("digest", ranges.remote, ranges.nbytes) == digest(
        arena, ranges.local, ranges.nbytes
    )


def _randomize(arena, lo, hi, seed):
    arena[lo:hi] = torch.randint(
        0, 256, (hi - lo,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def test_metadata_describes_the_peer(link):
    transport, peer, _ = link
    info = PeerInfo.decode(peer.metadata)
    assert (info.backend, info.name, info.arena_bytes) == (transport.backend, peer.name, ARENA)


@pytest.mark.parametrize(
    "local, remote",
    [(1000, 4096 * 3 + 7), (0, 64 * 1024)],  # unaligned; aligned (NIXL: prepared lists)
)
def test_large_read(link, local, remote):
    transport, peer, arena = link
    ranges = RangeBatch.single(local, remote, 64 * MIB)
    _run(transport, Op.READ, peer, ranges)
    expect_pattern(arena, ranges, SEED)


def test_large_write(link):
    transport, peer, arena = link
    _randomize(arena, 0, 64 * MIB + 3, seed=1)
    ranges = RangeBatch.single(3, WRITE_REGION[0] + 5, 64 * MIB)
    _run(transport, Op.WRITE, peer, ranges)
    _peer_holds(peer, arena, ranges)


def test_small_random_ranges(link):
    transport, peer, arena = link
    rng = np.random.default_rng(7)
    ranges = random_ranges(rng, 3000, 64 * 1024, (0, 64 * MIB), READ_REGION)
    _run(transport, Op.READ, peer, ranges)
    expect_pattern(arena, ranges, SEED)

    _randomize(arena, 0, 64 * MIB, seed=2)
    ranges = random_ranges(rng, 3000, 64 * 1024, (0, 64 * MIB), WRITE_REGION)
    _run(transport, Op.WRITE, peer, ranges)
    _peer_holds(peer, arena, ranges)


def test_granule_aligned_ranges(link):
    """Whole 16 KiB granules: NIXL posts them as index lists into its prepared lists."""
    transport, peer, arena = link
    rng = np.random.default_rng(8)
    g = 16 * 1024
    units = random_ranges(rng, 1500, 2, (0, 4096), (0, READ_REGION[1] // g))
    ranges = RangeBatch(units.local * g, units.remote * g, units.nbytes * g)
    if transport.backend == "nixl":
        assert transport.granule == g and transport._prepped(transport.peers[peer.name], ranges)
    _run(transport, Op.READ, peer, ranges)
    expect_pattern(arena, ranges, SEED)


def test_notifications_reach_the_peer(link):
    transport, peer, _ = link
    peer.call("notifications")  # drop earlier ones
    tag = f"{time.monotonic_ns()}".encode()
    _run(transport, Op.READ, peer, RangeBatch.single(0, 0, 4096), b"read:" + tag)
    _run(transport, Op.WRITE, peer, RangeBatch.single(0, WRITE_REGION[0], 4096), b"write:" + tag)
    got, deadline = [], time.monotonic() + 20
    while len(got) < 2 and time.monotonic() < deadline:
        got += peer.call("notifications")
        time.sleep(0.05)
    assert sorted(got) == [(transport.name, b"read:" + tag), (transport.name, b"write:" + tag)]


def test_offsets_above_2_gib(link):
    transport, peer, arena = link
    rng = np.random.default_rng(9)
    ranges = random_ranges(rng, 300, 16 * 1024, (HIGH, HIGH + 8 * MIB), TOP_READ)
    whole = RangeBatch.single(HIGH + 8 * MIB, TOP_READ[0] + 1, 8 * MIB - 1)
    for batch in (ranges, whole):
        _run(transport, Op.READ, peer, batch)
        expect_pattern(arena, batch, SEED)

    _randomize(arena, HIGH, ARENA, seed=3)
    ranges = random_ranges(rng, 300, 16 * 1024, (HIGH, ARENA), TOP_WRITE)
    _run(transport, Op.WRITE, peer, ranges)
    _peer_holds(peer, arena, ranges)
