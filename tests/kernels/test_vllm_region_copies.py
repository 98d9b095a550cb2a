"""The connector's local copies through `kernels.pack` (`transfer/vllm/region_copies.py`)
against the agent's own copies (`TransferAgent.copy_local`, what the worker ran before), on
random regions and random copies shaped as the worker makes them: staged spans scattered
into several regions, and a stage slot's chunks gathered from them. Both backends."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from transfer.agent import TransferAgent, stage_small
from transfer.dataplane import make_transport
from transfer.vllm.region_copies import RegionCopies

BACKENDS = ["torch", "triton"]
SIZES = (60_000, 4_096, 90_000)  # the described cache regions; the last one is staging


def _agent_and_regions(seed: int):
    gen = torch.Generator().manual_seed(seed)
    regions = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in SIZES]
    agent = TransferAgent(make_transport("ucx", f"copies-{uuid.uuid4().hex[:8]}"))
    agent.register(regions)
    return agent, regions


def _starts(agent) -> list[int]:
    return [r.start for r in agent.transport.region_map.regions]


def _disjoint(rng, region_start: int, region_bytes: int, count: int, max_bytes: int):
    """`count` non-overlapping ranges of one region (virtual offsets), shuffled."""
    lengths = rng.integers(1, max_bytes, count)
    gaps = rng.integers(0, 64, count)
    starts = np.cumsum(gaps + lengths) - lengths
    assert starts[-1] + lengths[-1] <= region_bytes
    order = rng.permutation(count)
    return (region_start + starts[order]).astype(np.int64), lengths[order].astype(np.int64)


def _staged_scatter(agent, rng):
    """A read's small ranges into regions 0 and 1, staged as the worker stages them: spans
    (gaps included) land in staging, then pieces are copied to their places."""
    starts = _starts(agent)
    local0, n0 = _disjoint(rng, starts[0], SIZES[0], 30, 900)
    local1, n1 = _disjoint(rng, starts[1], SIZES[1], 6, 300)
    local, nbytes = np.concatenate([local0, local1]), np.concatenate([n0, n1])
    remote = rng.permutation(np.cumsum(nbytes + rng.integers(0, 200, len(nbytes))))
    staged = stage_small(local, remote.astype(np.int64), nbytes, starts[2])
    assert staged.staged_ranges > 4 and staged.staging_bytes <= SIZES[2]
    return staged.copies


@pytest.mark.kernels
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name", BACKENDS)
def test_staged_scatter_equals_the_agents_copies(backend, name, seed):
    backend(name)
    rng = np.random.default_rng(seed)
    before, before_regions = _agent_and_regions(seed)
    after, after_regions = _agent_and_regions(seed)
    copies = _staged_scatter(before, rng)
    before.copy_local(*copies)
    RegionCopies(after_regions, after.transport.region_map).copy(*copies)
    for old, new in zip(before_regions, after_regions, strict=True):
        assert torch.equal(old, new)
    before.close(), after.close()


@pytest.mark.kernels
@pytest.mark.parametrize("name", BACKENDS)
def test_tail_gather_equals_the_agents_copies(backend, name):
    """Prefill's stage gather: ranges of regions 0 and 1 packed back to back in staging."""
    backend(name)
    rng = np.random.default_rng(7)
    before, before_regions = _agent_and_regions(7)
    after, after_regions = _agent_and_regions(7)
    starts = _starts(before)
    src0, n0 = _disjoint(rng, starts[0], SIZES[0], 20, 500)
    src1, n1 = _disjoint(rng, starts[1], SIZES[1], 5, 200)
    src, nbytes = np.concatenate([src0, src1]), np.concatenate([n0, n1])
    dst = starts[2] + 128 + np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
    before.copy_local(src, dst, nbytes)
    copies = RegionCopies(after_regions, after.transport.region_map)
    copies.copy(src, dst, nbytes)
    for old, new in zip(before_regions, after_regions, strict=True):
        assert torch.equal(old, new)
    packed = copies.gather(src, nbytes)
    assert torch.equal(packed, after_regions[2][128 : 128 + int(nbytes.sum())])
    before.close(), after.close()
