"""Several registered regions as one virtual offset space, over real NIXL and UCX, and the
TransferAgent's reads and settle check on top of them."""

import itertools

import numpy as np
import pytest
import torch

from transfer.agent import PeerReads, TransferAgent, stage_small
from transfer.dataplane import Op, RangeBatch, make_transport, wait
from transfer.dataplane.metadata import PeerInfo
from transfer.dataplane.regions import REGION_GAP, RegionMap
from transfer.errors import InvalidInput

SIZES = (3 * 4096 + 100, 64 * 1024, 5000)  # odd sizes: regions need not be page multiples
_names = itertools.count()


def _regions(seed: int | None) -> list[torch.Tensor]:
    out = []
    for i, size in enumerate(SIZES):
        t = torch.zeros(size, dtype=torch.uint8)
        if seed is not None:
            t.random_(0, 256, generator=torch.Generator().manual_seed(seed + i))
        out.append(t)
    return out


@pytest.fixture(params=["nixl", "ucx"])
def pair(request):
    n = next(_names)
    a = make_transport(request.param, f"ra{n}")
    b = make_transport(request.param, f"rb{n}")
    mine, theirs = _regions(None), _regions(5)
    a.register_regions(mine)
    meta_b = b.register_regions(theirs)
    a.add_peer(meta_b)
    yield a, b, mine, theirs
    a.close()
    b.close()


def test_place_keeps_regions_apart():
    placed = RegionMap.place([(1000, 10), (1, 5000), (99999, 1)])
    starts = [r.start for r in placed.regions]
    assert starts == [0, 2 * REGION_GAP, 5 * REGION_GAP]
    for left, right in itertools.pairwise(placed.regions):
        assert right.start >= left.start + left.nbytes + REGION_GAP
    assert RegionMap.from_list(placed.to_list()) == placed


def test_reads_land_in_the_right_region(pair):
    a, b, mine, theirs = pair
    v_mine, v_theirs = a.region_map.regions, b.region_map.regions
    rng = np.random.default_rng(2)
    rows = []
    for _ in range(200):
        i, j = rng.integers(0, len(SIZES), 2)
        n = int(rng.integers(1, min(SIZES[i], SIZES[j]) // 4))
        local = int(rng.integers(0, SIZES[i] - n))
        remote = int(rng.integers(0, SIZES[j] - n))
        rows.append((i, j, local, remote, n))
    # One destination byte is written once: keep the rows whose destinations are disjoint.
    taken = [np.zeros(s, dtype=bool) for s in SIZES]
    kept = []
    for i, j, local, remote, n in rows:
        if not taken[i][local : local + n].any():
            taken[i][local : local + n] = True
            kept.append((i, j, local, remote, n))
    batch = RangeBatch.of(
        (v_mine[i].start + local, v_theirs[j].start + remote, n) for i, j, local, remote, n in kept
    )
    handle = a.post(Op.READ, b.name, batch, deadline_s=20)
    assert wait(a, handle).done
    a.release(handle)
    for i, j, local, remote, n in kept:
        assert torch.equal(mine[i][local : local + n], theirs[j][remote : remote + n])


def test_a_range_across_a_region_boundary_is_refused(pair):
    a, b, _, _ = pair
    first = b.region_map.regions[0]
    crossing = RangeBatch.single(0, first.start + first.nbytes - 8, 16)  # into the gap
    with pytest.raises(InvalidInput, match="ranges.remote.*region boundary"):
        a.post(Op.READ, b.name, crossing, deadline_s=5)
    mine = a.region_map.regions[1]
    crossing = RangeBatch.single(mine.start - 4, 0, 8)
    with pytest.raises(InvalidInput, match="ranges.local.*region boundary"):
        a.post(Op.READ, b.name, crossing, deadline_s=5)


def test_metadata_carries_the_regions():
    transport = make_transport("nixl", f"rm{next(_names)}")
    try:
        info = PeerInfo.decode(transport.register_regions(_regions(None)))
        assert info.region_map() == transport.region_map
        assert info.arena_bytes == transport.region_map.extent
    finally:
        transport.close()


def test_agent_reads_and_reports_bytes_and_descriptors():
    a = TransferAgent(make_transport("nixl", f"ga{next(_names)}"))
    b = TransferAgent(make_transport("nixl", f"gb{next(_names)}"))
    try:
        mine, theirs = _regions(None), _regions(9)
        a.register(mine)
        peer = a.connect(b.register(theirs))
        assert a.connect(b.metadata) == peer  # connected once
        v_mine, v_theirs = a.transport.region_map.regions, b.transport.region_map.regions
        batch = RangeBatch.of([(v_mine[1].start, v_theirs[0].start, 4096),
                               (v_mine[2].start + 7, v_theirs[2].start + 9, 300)])  # fmt: skip
        a.post("req-1", [PeerReads(peer, batch)])
        finished = []
        for _ in range(20000):
            finished += a.poll()
            if finished:
                break
        assert [f.key for f in finished] == ["req-1"] and finished[0].ok
        assert (finished[0].nbytes, finished[0].descriptors) == (4396, 2)
        assert torch.equal(mine[1][:4096], theirs[0][:4096])
        assert torch.equal(mine[2][7:307], theirs[2][9:309])
        assert a.in_flight == 0
    finally:
        a.close()
        b.close()


def test_agent_failure_is_reported_once_settled():
    a = TransferAgent(make_transport("nixl", f"fa{next(_names)}"))
    b = TransferAgent(make_transport("nixl", f"fb{next(_names)}"))
    try:
        a.register(_regions(None))
        peer = a.connect(b.register(_regions(1)))
        outside = RangeBatch.single(0, b.transport.region_map.extent + 10, 8)
        a.post("bad", [PeerReads(peer, outside)])
        finished = a.poll()
        assert [f.key for f in finished] == ["bad"]
        assert not finished[0].ok and "arena" in finished[0].error
    finally:
        a.close()
        b.close()


def test_agent_stages_neighbouring_small_ranges():
    """Pieces that sit together at the source but apart at the destination cross as one
    read into staging, then land by local copies: fewer descriptors, the same bytes."""
    a = TransferAgent(make_transport("nixl", f"sa{next(_names)}"))
    b = TransferAgent(make_transport("nixl", f"sb{next(_names)}"))
    try:
        mine, theirs = _regions(None), _regions(4)
        staging = torch.zeros(1 << 16, dtype=torch.uint8)
        a.register([*mine, staging])
        peer = a.connect(b.register(theirs))
        v_mine, v_theirs = a.transport.region_map.regions, b.transport.region_map.regions
        # 16 pieces of 256 B, 64 B apart at the source, reversed and spread at the destination.
        remote = v_theirs[1].start + np.arange(16) * 320
        local = v_mine[1].start + (15 - np.arange(16)) * 1024
        nbytes = np.full(16, 256)
        staged = stage_small(local, remote, nbytes, v_mine[-1].start)
        assert len(staged.wire[2]) == 1 and staged.staged_ranges == 16
        a.post("s", [PeerReads(peer, RangeBatch(*staged.wire))], staged.copies)
        finished = []
        for _ in range(20000):
            finished += a.poll()
            if finished:
                break
        assert finished[0].ok and finished[0].descriptors == 1
        assert finished[0].nbytes == 15 * 320 + 256  # the gaps cross too
        for i in range(16):
            at, src = (15 - i) * 1024, i * 320
            assert torch.equal(mine[1][at : at + 256], theirs[1][src : src + 256])
        assert not mine[1][256:1024].any()  # nothing beyond the pieces
    finally:
        a.close()
        b.close()
