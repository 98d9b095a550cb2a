"""Every backend, two transports in this one process: bytes, notifications, errors."""

import itertools
import sys
import time

import numpy as np
import pytest
import torch

from tests.support.dataplane import digest, expect_pattern, fill, random_ranges
from transfer.dataplane import BACKENDS, Op, RangeBatch, make_transport, wait
from transfer.errors import Closed, InvalidInput, NotFound, WrongState

ARENA = 8 << 20
SEED = 11
_names = itertools.count()


@pytest.fixture(params=["local", "nixl", "ucx"])
def pair(request):
    """(a, b, arena_a, arena_b): a is connected to b; b's arena holds the pattern."""
    backend = request.param
    n = next(_names)
    a = make_transport(backend, f"a{n}")
    b = make_transport(backend, f"b{n}")
    arena_a = torch.zeros(ARENA, dtype=torch.uint8)
    arena_b = torch.empty(ARENA, dtype=torch.uint8)
    fill(arena_b, SEED, [(0, ARENA)])
    meta_a = a.register(arena_a)
    assert a.add_peer(b.register(arena_b)) == b.name
    b.add_peer(meta_a)
    yield a, b, arena_a, arena_b
    a.close()
    b.close()


def _notifications(transport, count, timeout_s=10.0):
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += [(n.peer, n.message) for n in transport.notifications()]
        time.sleep(0.005)
    return got


def test_read_and_write_random_ranges(pair):
    a, b, arena_a, arena_b = pair
    rng = np.random.default_rng(1)
    ranges = random_ranges(rng, 500, 8192, (0, ARENA // 2), (0, ARENA))
    h = a.post(Op.READ, b.name, ranges, b"read-1", deadline_s=20)
    assert wait(a, h).done
    a.release(h)
    expect_pattern(arena_a, ranges, SEED)

    arena_a.random_(0, 256, generator=torch.Generator().manual_seed(3))
    ranges = random_ranges(rng, 300, 20000, (0, ARENA), (ARENA // 2, ARENA))
    h = a.post(Op.WRITE, b.name, ranges, b"write-1", deadline_s=20)
    assert wait(a, h).done
    a.release(h)
    assert digest(arena_b, ranges.remote, ranges.nbytes) == digest(
        arena_a, ranges.local, ranges.nbytes
    )
    assert sorted(_notifications(b, 2)) == [(a.name, b"read-1"), (a.name, b"write-1")]
    assert a.notifications() == []


def test_one_large_range_and_adjacent_pieces(pair):
    a, b, arena_a, _ = pair
    whole = RangeBatch.single(4096, 3 * 4096, 4 << 20)
    pieces = RangeBatch(
        [4096, 4096 + (1 << 20)], [3 * 4096, 3 * 4096 + (1 << 20)], [1 << 20, 3 << 20]
    )
    for batch in (whole, pieces, RangeBatch.single(1, 12345, (1 << 20) + 3)):
        arena_a.zero_()
        h = a.post(Op.READ, b.name, batch, deadline_s=20)
        assert wait(a, h).done
        expect_pattern(arena_a, batch, SEED)


def test_transfers_in_flight_together(pair):
    a, b, arena_a, _ = pair
    rng = np.random.default_rng(2)
    batches = [random_ranges(rng, 50, 4096, (i << 20, (i + 1) << 20), (0, ARENA)) for i in range(4)]
    handles = [
        a.post(Op.READ, b.name, r, f"n{i}".encode(), deadline_s=20) for i, r in enumerate(batches)
    ]
    assert all(wait(a, h).done for h in handles)
    for batch in batches:
        expect_pattern(arena_a, batch, SEED)
    assert sorted(m for _, m in _notifications(b, 4)) == [b"n0", b"n1", b"n2", b"n3"]


def test_bad_posts_raise_value_errors_naming_the_field(pair):
    a, b, _, _ = pair
    ok = RangeBatch.single(0, 0, 16)
    cases = [
        (("READ", b.name, ok), InvalidInput, "op"),
        ((Op.READ, "nobody", ok), NotFound, "peer"),
        ((Op.READ, b.name, [(0, 0, 16)]), InvalidInput, "ranges"),
        ((Op.READ, b.name, RangeBatch.single(ARENA - 8, 0, 16)), InvalidInput, r"ranges\.local"),
        ((Op.WRITE, b.name, RangeBatch.single(0, ARENA, 1)), InvalidInput, r"ranges\.remote"),
        ((Op.READ, b.name, ok, "text"), InvalidInput, "notif"),
        ((Op.READ, b.name, ok, b"x" * 5000), InvalidInput, "notif"),
    ]
    for args, kind, field in cases:
        with pytest.raises(kind, match=field):
            a.post(*args, deadline_s=5)
    for deadline in (0, -1, float("inf"), "5"):
        with pytest.raises(InvalidInput, match="deadline_s"):
            a.post(Op.READ, b.name, ok, deadline_s=deadline)
    with pytest.raises(NotFound, match="handle"):
        a.poll(12345)
    h = a.post(Op.READ, b.name, ok, deadline_s=5)
    wait(a, h)
    a.release(h)
    with pytest.raises(NotFound, match="handle"):
        a.release(h)


def test_registration_and_peer_errors(pair):
    a, b, arena_a, _ = pair
    with pytest.raises(WrongState, match="already registered"):
        a.register(arena_a)
    with pytest.raises(ValueError, match="itself"):
        a.add_peer(_meta_of(a))
    other = "ucx" if a.backend != "ucx" else "local"
    foreign = make_transport(other, f"foreign{next(_names)}")
    try:
        with pytest.raises(ValueError, match="backend"):
            a.add_peer(foreign.register(torch.zeros(4096, dtype=torch.uint8)))
    finally:
        foreign.close()
    a.remove_peer(b.name)
    with pytest.raises(NotFound, match="peer"):
        a.post(Op.READ, b.name, RangeBatch.single(0, 0, 1), deadline_s=5)


def _meta_of(transport):
    from transfer.dataplane.metadata import PeerInfo

    arena = transport.arena
    return PeerInfo(
        transport.backend, transport.name, arena.nbytes, arena.device, 0, arena.address
    ).encode()


def test_a_closed_transport_refuses_calls():
    t = make_transport("local", f"closed{next(_names)}")
    t.close()
    with pytest.raises(Closed, match="is closed"):
        t.register(torch.zeros(4096, dtype=torch.uint8))


@pytest.mark.parametrize(
    "arena",
    [
        torch.zeros(16, dtype=torch.float32),
        torch.zeros(4, 4, dtype=torch.uint8),
        torch.zeros(32, dtype=torch.uint8)[::2],
        torch.zeros(0, dtype=torch.uint8),
        np.zeros(16, dtype=np.uint8),
    ],
)
def test_bad_arenas_are_refused(arena):
    t = make_transport("local", f"arena{next(_names)}")
    try:
        with pytest.raises(ValueError, match="arena"):
            t.register(arena)
    finally:
        t.close()


def test_factory_names_backends_options_and_missing_packages(monkeypatch):
    with pytest.raises(ValueError, match="nixl, ucx, local"):
        make_transport("rdma", "x")
    with pytest.raises(ValueError, match="granule"):
        make_transport("local", "x", granule=4096)
    with pytest.raises(ValueError, match="agent_name"):
        make_transport("local", "")
    assert set(BACKENDS) == {"nixl", "ucx", "local"}
    for module in [m for m in sys.modules if m.startswith("transfer.dataplane.ucx")]:
        monkeypatch.delitem(sys.modules, module)
    for module in [m for m in sys.modules if m == "ucxx" or m.startswith("ucxx.")]:
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setitem(sys.modules, "ucxx", None)
    with pytest.raises(ImportError, match=r"pip install 'pdxfer\[ucx\]'"):
        make_transport("ucx", "x")
    for module in [m for m in sys.modules if m.startswith("transfer.dataplane.nixl")]:
        monkeypatch.delitem(sys.modules, module)
    for module in [m for m in sys.modules if m == "nixl" or m.startswith("nixl.")]:
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setitem(sys.modules, "nixl", None)
    with pytest.raises(ImportError, match="pip install nixl"):
        make_transport("nixl", "x")


def test_nixl_prepared_and_per_transfer_descriptors_agree():
    """The granule path (index lists) and the per-transfer path move the same bytes."""
    peer = make_transport("nixl", "nixl-peer")
    arena_p = torch.empty(ARENA, dtype=torch.uint8)
    fill(arena_p, SEED, [(0, ARENA)])
    meta = peer.register(arena_p)
    rng = np.random.default_rng(5)
    aligned = random_ranges(rng, 64, 2, (0, 512), (0, 2048))
    aligned = RangeBatch(aligned.local * 4096, aligned.remote * 4096, aligned.nbytes * 4096)
    long = RangeBatch.single(0, 4096, 64 * 4096)  # one descriptor beats 64 indices
    try:
        for granule in (4096, 0):
            t = make_transport("nixl", f"nixl-{granule}", granule=granule)
            arena = torch.zeros(ARENA, dtype=torch.uint8)
            t.register(arena)
            t.add_peer(meta)
            assert t._prepped(t.peers["nixl-peer"], aligned) == (granule == 4096)
            assert not t._prepped(t.peers["nixl-peer"], long)
            assert wait(t, t.post(Op.READ, "nixl-peer", aligned, deadline_s=20)).done
            expect_pattern(arena, aligned, SEED)
            t.close()
    finally:
        peer.close()


@pytest.mark.parametrize("backend", ["local", "ucx"])
def test_closed_peer_fails_by_its_deadline(backend):
    n = next(_names)
    a, b = make_transport(backend, f"c{n}"), make_transport(backend, f"d{n}")
    a.register(torch.zeros(1 << 20, dtype=torch.uint8))
    a.add_peer(b.register(torch.zeros(1 << 20, dtype=torch.uint8)))
    b.close()
    start = time.monotonic()
    status = wait(a, a.post(Op.READ, b.name, RangeBatch.single(0, 0, 4096), deadline_s=1.0))
    assert status.failed and status.reason
    assert time.monotonic() - start < 1.0 + 2.0
    a.close()


def test_removing_a_peer_fails_its_pending_transfers():
    """A ucx transfer stays pending until its server answers; removing the peer ends it."""
    a, b = make_transport("ucx", "rm-a"), make_transport("ucx", "rm-b")
    a.register(torch.zeros(1 << 20, dtype=torch.uint8))
    a.add_peer(b.register(torch.zeros(1 << 20, dtype=torch.uint8)))
    b._server.stop()  # nobody serves any more, the worker stays up
    h = a.post(Op.READ, b.name, RangeBatch.single(0, 0, 4096), deadline_s=30)
    assert a.poll(h).pending
    a.remove_peer(b.name)
    status = a.poll(h)
    assert status.failed and "removed" in status.reason
    a.close()
    b.close()


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_ucx_server_refuses_ranges_outside_its_arena(op):
    """The requester checks bounds first; a stale view of the peer's arena still gets a
    clear refusal from the serving side, and a refused WRITE lands nowhere."""
    from dataclasses import replace

    n = next(_names)
    a, b = make_transport("ucx", f"ra{n}"), make_transport("ucx", f"rb{n}")
    arena_b = torch.zeros(1 << 16, dtype=torch.uint8)
    a.register(torch.ones(1 << 20, dtype=torch.uint8))
    a.add_peer(b.register(arena_b))
    stale = replace(a.peers[b.name], arena_bytes=1 << 20)  # as if b's arena had been larger
    record, status = a._post(op, stale, RangeBatch.single(0, 1 << 15, 1 << 16), b"", 5.0)
    assert status.pending
    deadline = time.monotonic() + 10
    while (status := a._check(record)).pending and time.monotonic() < deadline:
        time.sleep(0.005)
    assert status.failed and "refused" in status.reason and "arena" in status.reason
    assert not arena_b.any()
    a._discard(record)
    a.close()
    b.close()
