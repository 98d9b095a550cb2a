"""`bench transfer`'s ranks read through the TransferAgent with serving's failure rule: a
failed job raises only once nothing of it can still land, and leaves nothing in flight.
Two ranks in this process over real NIXL on loopback."""

import itertools

import pytest

from transfer.agent.staging import StagingArea
from transfer.bench.transfer_rank import BenchRank, BenchRankSpec, ReadItem
from transfer.dataplane import RangeBatch
from transfer.errors import InvalidInput
from transfer.serving.role import ServeRole

ARENA = 1 << 16
_names = itertools.count()


def _rank(role: ServeRole) -> BenchRank:
    n = next(_names)
    spec = BenchRankSpec(role, f"bench-{role}-{n}", 0, 1, ARENA, "nixl", (), seed=n,
                         staging=StagingArea(ARENA // 2, ARENA, ARENA // 2))  # fmt: skip
    return BenchRank(spec)


@pytest.fixture
def ranks():
    prefill, decode = _rank(ServeRole.PREFILL), _rank(ServeRole.DECODE)
    decode.add_peers((prefill.metadata,))
    yield prefill, decode
    decode.close()
    prefill.close()


def test_a_read_job_lands_its_bytes(ranks):
    prefill, decode = ranks
    decode.prepare("ok", "read", (ReadItem(0, RangeBatch.single(100, 2000, 4096)),))
    assert decode.run("ok", deadline_s=10.0) > 0
    assert decode.arena[100:4196].equal(prefill.arena[2000:6096])
    assert decode.agent.in_flight == 0


def test_a_refused_job_raises_and_leaves_nothing_in_flight(ranks):
    _, decode = ranks
    outside = RangeBatch.single(0, ARENA + 64, 128)  # past the prefill rank's arena
    decode.prepare("bad", "read", (ReadItem(0, outside),))
    with pytest.raises(InvalidInput, match="past the remote arena"):
        decode.run("bad", deadline_s=10.0)
    assert decode.agent.in_flight == 0
    assert decode.agent.settled("bad")
    # The same job key runs again: nothing of the failed run is left under it.
    decode.prepare("again", "read", (ReadItem(0, RangeBatch.single(0, 0, 64)),))
    assert decode.run("again", deadline_s=10.0) > 0
