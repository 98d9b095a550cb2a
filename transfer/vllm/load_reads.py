"""One decode rank's reads of one load, ready to post: the cache's reads (`load_plan`), with
small neighbouring ranges and the staged tail (`stage_tail`) landing in the staging buffer
when it has room, and -- verify -- every prefill rank's digest table of the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from transfer.agent import PeerReads, TransferAgent, stage_small
from transfer.cache.explicit_layout import ExplicitLayout
from transfer.dataplane import RangeBatch
from transfer.errors import InvalidInput
from transfer.vllm.digests import table_bytes
from transfer.vllm.load_plan import CacheGroup, plan_load
from transfer.vllm.metadata import LoadSpec
from transfer.vllm.region_copies import Columns
from transfer.vllm.staging_buffer import StagingBuffer


@dataclass(frozen=True)
class PrefillRanks:
    """A prefill instance as this rank reads it."""

    layouts: tuple[ExplicitLayout, ...]
    agents: tuple[str, ...]  # connected transport peer per prefill rank


@dataclass(frozen=True)
class DigestTables:
    """A load's digest tables (verify): the prefill ranks' layouts, and per prefill rank
    where its table lands in staging, (offset, bytes)."""

    layouts: tuple[ExplicitLayout, ...]
    landed: tuple[tuple[int, int], ...]


def tables_key(request_id: str) -> str:
    """The staging hold of a load's digest tables (apart from its staged reads)."""
    return f"{request_id}#digests"


class LoadPlanner:
    """The reads of decode rank `rank` (its layout `layouts[rank]`), staged in `staging`."""

    def __init__(
        self,
        groups: Sequence[CacheGroup],
        layouts: Sequence[ExplicitLayout],
        rank: int,
        staging: StagingBuffer,
        agent: TransferAgent,
    ) -> None:
        self.groups = tuple(groups)
        self.layouts = tuple(layouts)
        self.rank = rank
        self.staging = staging
        self._agent = agent

    def cache_reads(
        self, load: LoadSpec, peer: PrefillRanks
    ) -> tuple[list[PeerReads], Columns | None]:
        """The load's reads, and the staging -> cache copies once they landed (None: all
        read directly). Small neighbouring ranges are staged when staging has room. A staged
        tail (the partial last block) lands in staging too; without room for all of it, that
        block crosses whole."""
        plan = partial(
            plan_load,
            self.groups,
            peer.layouts,
            self.layouts,
            self.rank,
            load.ticket.block_ids,
            load.block_ids,
            load.num_tokens,
        )
        reads = plan(load.ticket.staged_offsets)
        sources = list(reads.per_source.items())
        sizes = [stage_small(dst, src, n, 0).staging_bytes for _, (src, dst, n) in sources]
        tail_bytes = reads.tail.nbytes if reads.tail is not None else 0
        total = sum(sizes) + tail_bytes
        offset = self.staging.hold(load.request_id, total) if total else None
        if offset is None and reads.tail is not None:
            reads = plan(())
            sources = list(reads.per_source.items())
        if offset is None:
            direct = [
                PeerReads(peer.agents[p], RangeBatch(dst, src, n)) for p, (src, dst, n) in sources
            ]
            return direct, None
        posted, copies = [], []
        base = self.staging.start + offset
        if reads.tail is not None:
            self._agent.zero_local(*reads.tail.clear)  # before anything of the load lands
            tail_sources, tail_copies = reads.tail.shifted(base)
            base += tail_bytes
            for p, (src, dst, n) in tail_sources.items():
                posted.append(PeerReads(peer.agents[p], RangeBatch(dst, src, n)))
            copies.append(tail_copies)
        for (p, (src, dst, n)), size in zip(sources, sizes, strict=True):
            staged = stage_small(dst, src, n, base)
            base += size
            posted.append(PeerReads(peer.agents[p], RangeBatch(*staged.wire)))
            copies.append(staged.copies)
        joined = tuple(np.concatenate(c) for c in zip(*copies, strict=True))
        return posted, joined

    def table_reads(
        self, load: LoadSpec, peer: PrefillRanks
    ) -> tuple[list[PeerReads], DigestTables]:
        """Every prefill rank's digest table of the request, read into staging (InvalidInput
        when staging has no room: the load then fails)."""
        sizes = [table_bytes(layout) for layout in peer.layouts]
        at = self.staging.hold(tables_key(load.request_id), sum(sizes))
        if at is None:
            raise InvalidInput("verify: no staging room for the prefill ranks' digest tables")
        reads, landed = [], []
        for agent, remote, size in zip(peer.agents, load.ticket.digest_offsets, sizes, strict=True):
            local = np.asarray([self.staging.start + at], dtype=np.int64)
            ranges = RangeBatch(local, np.asarray([remote], dtype=np.int64), np.asarray([size]))
            reads.append(PeerReads(agent, ranges))
            landed.append((at, size))
            at += size
        return reads, DigestTables(peer.layouts, tuple(landed))
