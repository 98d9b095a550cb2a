"""Plan a request's transfer into a decode instance: per rank, the READs and (when the
packer stages) the gathers the prefill ranks run first and the scatters that follow.

Staging takes three steps. The decode side plans with room in both staging pools, then
takes an extent of its own pool and asks the prefill instance (`Stage`) to pack the
plan's small ranges into an extent of its pool. Then it plans again into exactly those
two extents: the same plan, at its final offsets. Anything short of that (no room on
either side, a prefill instance without staging) reads every range directly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from transfer.cache.layout import Layout
from transfer.cache.staging_pool import StagingPool
from transfer.control.errors import ControlError, GrpcCode
from transfer.control.types import RankGather, StageRequest, Ticket
from transfer.packer import (
    StagingPolicy,
    StagingWindow,
    TransferPlan,
    TransferRequest,
    plan_transfer,
    prefill_gathers,
    staging_extents,
)
from transfer.serving.ranks.spec import STAGING_RESERVED_BYTES, Copies, RankReads, ReadBatch

logger = logging.getLogger(__name__)

# What `Stage` answers when the prefill instance cannot stage: read directly instead.
STAGING_REFUSED = (GrpcCode.RESOURCE_EXHAUSTED, GrpcCode.UNIMPLEMENTED)


class Stager(Protocol):
    def stage(self, request: StageRequest) -> int: ...


@dataclass(frozen=True)
class Reads:
    """The transfer of one request, planned: per-rank READs and what they move."""

    per_rank: tuple[RankReads, ...]
    kv_bytes: int
    state_bytes: int
    descriptors: int
    staged_bytes: int = 0  # packed on the prefill side (all ranks), 0 when all direct


def transfer_request(ticket: Ticket, blocks: Sequence[int], slot: int) -> TransferRequest:
    return TransferRequest(
        num_tokens=ticket.num_tokens,
        src_blocks=ticket.block_ids,
        src_slots=(ticket.slot_id,),
        dst_blocks=tuple(blocks),
        dst_slots=(slot,),
    )


def reads_of(plans: Sequence[TransferPlan]) -> Reads:
    per_rank = tuple(
        RankReads(
            tuple(
                ReadBatch(s.prefill_rank, s.wire.dst, s.wire.src, s.wire.lengths)
                for s in plan.sources
                if len(s.wire)
            ),
            _scatter(plan),
        )
        for plan in plans
    )
    return Reads(
        per_rank,
        sum(p.kv_bytes for p in plans),
        sum(p.state_bytes for p in plans),
        sum(p.descriptors for p in plans),
        sum(s.gather.nbytes for p in plans for s in p.sources),
    )


def _scatter(plan: TransferPlan) -> Copies:
    parts = [s.scatter for s in plan.sources if len(s.scatter)]
    if not parts:
        return Copies.empty()
    src, dst, nbytes = (np.concatenate(c) for c in zip(*(p.arrays() for p in parts), strict=True))
    order = np.argsort(src, kind="stable")  # one staging extent, back to back
    return Copies(src[order], dst[order], nbytes[order])


def plan_direct(
    prefill: Sequence[Layout],
    decode: Sequence[Layout],
    request: TransferRequest,
    tokens: tuple[int, int] | None = None,
) -> Reads:
    policy = StagingPolicy(enabled=False)
    return reads_of(plan_transfer(prefill, decode, request, policy, tokens=tokens))


def _room(layouts: Sequence[Layout]) -> StagingWindow | None:
    """The part of an instance's staging area its pool hands out (None: no pool)."""
    usable = layouts[0].staging_bytes - STAGING_RESERVED_BYTES
    return StagingWindow(STAGING_RESERVED_BYTES, usable) if usable > 0 else None


def may_stage(
    prefill: Sequence[Layout],
    decode: Sequence[Layout],
    direct: Reads,
    pool: StagingPool | None,
    min_packed: int,
) -> bool:
    """Whether `plan_reads`, given a stager, would try to stage rather than read `direct`:
    both instances have staging room and the direct plan is long enough to pay for a Stage."""
    has_room = pool is not None and _room(prefill) is not None and _room(decode) is not None
    return has_room and direct.descriptors >= min_packed


def plan_reads(
    prefill: Sequence[Layout],
    decode: Sequence[Layout],
    request: TransferRequest,
    *,
    request_id: str = "",
    holder: str = "",
    stager: Stager | None = None,
    pool: StagingPool | None = None,
    min_small_ranges: int = 8,
    min_packed: int = 1,
    reused_tokens: int = 0,
) -> Reads:
    """Per decode rank, the READs that pull `request`'s cache. With a `stager` (the prefill
    instance's client) and a `pool` (this instance's staging), many small ranges from a
    prefill rank are packed and cross as one READ; the decode extent stays held by
    `request_id` in `pool` until the caller frees it. The KV of the first `reused_tokens`
    (blocks the decode side already holds) is not read; the state always is. A transfer
    that would pack fewer than `min_packed` ranges reads directly: staging saves less than
    its Stage round trip costs. The packer stages a subset of the direct plan's ranges, so
    a direct plan of fewer ranges needs no second plan to tell."""
    part = {"tokens": (reused_tokens, request.num_tokens)} if reused_tokens else {}
    if stager is None:
        return plan_direct(prefill, decode, request, **part)
    direct = plan_direct(prefill, decode, request, **part)
    if not may_stage(prefill, decode, direct, pool, min_packed):
        return direct
    p_room, d_room = _room(prefill), _room(decode)
    policy = StagingPolicy(min_small_ranges=min_small_ranges)
    d_free = StagingWindow(d_room.offset, min(d_room.nbytes, pool.largest_free_bytes))
    plans = plan_transfer(prefill, decode, request, policy, p_room, d_free, **part)
    p_bytes, d_bytes = staging_extents(plans)
    if not p_bytes:
        return reads_of(plans)
    gathers = prefill_gathers(plans, len(prefill))
    if sum(len(gather) for gather in gathers) < min_packed:  # ranges packed on all ranks
        return direct
    d_offset = pool.allocate(request_id, d_bytes)
    if d_offset is None:
        return direct
    try:
        stage = StageRequest(
            request_id,
            holder,
            tuple(RankGather(tuple(g.src.tolist()), tuple(g.lengths.tolist())) for g in gathers),
        )
        p_offset = stager.stage(stage) - prefill[0].staging_offset
    except ControlError as exc:
        pool.free(request_id)
        if exc.code not in STAGING_REFUSED:
            raise
        logger.info("staging %r refused (%s): reading directly", request_id, exc)
        return direct
    except BaseException:
        pool.free(request_id)
        raise
    try:
        windows = StagingWindow(p_offset, p_bytes), StagingWindow(d_offset, d_bytes)
        plans = plan_transfer(prefill, decode, request, policy, *windows, **part)
        for staged, planned in zip(gathers, prefill_gathers(plans, len(prefill)), strict=True):
            if not (
                np.array_equal(staged.src, planned.src)
                and np.array_equal(staged.lengths, planned.lengths)
            ):
                raise AssertionError("the final plan packs other ranges than were staged")
    except BaseException:  # e.g. an offset outside the prefill's staging area
        pool.free(request_id)
        raise
    return reads_of(plans)
