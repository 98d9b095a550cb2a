"""Pure-data setup of `pdxfer bench transfer`: arena sizing, fragmented allocations, plans.

Nothing here touches a tensor: layouts, pools and plans are values, so the driver builds
them in-process and ships each rank only the ranges it posts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from transfer.bench.prefill_model import StreamGroup
from transfer.cache import BlockPool, Layout, LayoutOptions, SlotPool, fragment
from transfer.geometry import ModelGeometry
from transfer.packer import StagingPolicy, TransferPlan, TransferRequest, plan_transfer
from transfer.serving.role import ServeRole

# After `fragment` (fill 0.7, keep 0.5) about 65% of a pool is free; size pools so the
# largest request needs at most this share of them.
FREE_SHARE = 0.6
SLOTS = 16
HOLE_BLOCKS = 8  # `fragment`'s default: earlier requests of 1..8 blocks, the most fragmented
STAGING_HEADROOM = 1 << 20
# A vLLM-like layout for the naive comparison: per-layer KV regions and state slot arrays.
NAIVE_OPTIONS = LayoutOptions(kv_order="layer_first", state_placement="per_layer")


@dataclass(frozen=True)
class Instances:
    """The layouts of both instances: ours (pdxfer defaults) and the vLLM-like ones."""

    prefill: tuple[Layout, ...]
    decode: tuple[Layout, ...]
    naive_prefill: tuple[Layout, ...]
    naive_decode: tuple[Layout, ...]
    # Grouped lanes for layer-wise streaming (`LayoutOptions.layer_group`); () when off.
    stream_prefill: tuple[Layout, ...] = ()
    stream_decode: tuple[Layout, ...] = ()

    def arena_bytes(self, side: ServeRole) -> int:
        """One rank's arena: big enough for every layout of that side."""
        layouts = (
            (self.prefill, self.naive_prefill, self.stream_prefill)
            if side is ServeRole.PREFILL
            else (self.decode, self.naive_decode, self.stream_decode)
        )
        return max(each[0].arena_bytes for each in layouts if each)

    @property
    def total_bytes(self) -> int:
        prefill, decode = self.arena_bytes(ServeRole.PREFILL), self.arena_bytes(ServeRole.DECODE)
        return prefill * len(self.prefill) + decode * len(self.decode)


def pool_blocks(geometry: ModelGeometry, block_size: int, max_tokens: int) -> int:
    needed = math.ceil(max_tokens / block_size) if geometry.attention_layers else 0
    return math.ceil(needed / FREE_SHARE) + 16 if needed else 0


def build_instances(
    geometry: ModelGeometry,
    prefill_tp: int,
    decode_tp: int,
    block_size: int,
    max_tokens: int,
    staging_bytes: int = 0,
    layer_group: int = 0,
) -> Instances:
    """`layer_group` > 0 adds layouts with streaming groups of that many layers."""
    num_blocks = pool_blocks(geometry, block_size, max_tokens)

    def side(tp: int, options: LayoutOptions, staging: int) -> tuple[Layout, ...]:
        first = Layout(
            geometry, tp, 0, block_size, num_blocks, SLOTS, options=options, staging_bytes=staging
        )
        return first.all_ranks()

    grouped = LayoutOptions(layer_group=layer_group)
    return Instances(
        side(prefill_tp, LayoutOptions(), staging_bytes),
        side(decode_tp, LayoutOptions(), staging_bytes),
        side(prefill_tp, NAIVE_OPTIONS, 0),
        side(decode_tp, NAIVE_OPTIONS, 0),
        side(prefill_tp, grouped, 0) if layer_group else (),
        side(decode_tp, grouped, 0) if layer_group else (),
    )


def fit_geometry(
    geometry: ModelGeometry,
    tp_pairs: Sequence[tuple[int, int]],
    block_size: int,
    max_tokens: int,
    max_arena_bytes: int,
) -> ModelGeometry:
    """The most leading layers of `geometry` whose arenas, for the largest request and every
    TP pair, fit `max_arena_bytes` across all ranks. ValueError when not even one does."""

    def fits(candidate: ModelGeometry) -> bool:
        return all(
            build_instances(candidate, p, d, block_size, max_tokens).total_bytes <= max_arena_bytes
            for p, d in tp_pairs
        )

    if fits(geometry):
        return geometry
    low, high = 0, len(geometry.layers)  # fits(low) is unknown; low=0 means "none"
    while high - low > 1:
        mid = (low + high) // 2
        if fits(geometry.with_num_layers(mid)):
            low = mid
        else:
            high = mid
    if low == 0:
        raise ValueError(
            f"--max-arena-bytes: {max_arena_bytes} B cannot hold even one layer of "
            f"{geometry.name} at {max_tokens} tokens"
        )
    scaled = geometry.with_num_layers(low)
    if not scaled.attention_layers or not scaled.linear_layers:
        raise ValueError(
            f"--max-arena-bytes: only {low} of {geometry.name}'s layers fit at {max_tokens} "
            "tokens, too few to keep both linear and attention layers; raise the limit"
        )
    return scaled


def fragmented_request(
    layout: Layout,
    num_tokens: int,
    rng: random.Random,
    hole_blocks: int = HOLE_BLOCKS,
    policy: str = "contiguous",
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Block and slot ids of one request on pools fragmented as after serving many requests
    of 1..`hole_blocks` blocks each (`fragment`), allocated by the block pool's `policy`.
    The history depends only on `rng`, so two policies given equal rngs replay the same
    one."""
    blocks, slots = BlockPool(layout.num_blocks, policy), SlotPool(layout.num_slots)
    need = layout.blocks_for(num_tokens)
    for pool, enough in ((blocks, lambda: blocks.num_free >= need), (slots, slots.can_allocate)):
        held = fragment(pool, rng, max_request_blocks=hole_blocks)
        while not enough():
            pool.free(held.pop(rng.randrange(len(held))))
    return tuple(blocks.allocate(need)), tuple(slots.allocate())


def make_request(
    instances: Instances,
    num_tokens: int,
    seed: int,
    hole_blocks: int = HOLE_BLOCKS,
    policy: str = "contiguous",
) -> TransferRequest:
    """One request on both sides' fragmented pools; equal seeds give equal histories."""
    rng = random.Random(seed)
    src = fragmented_request(instances.prefill[0], num_tokens, rng, hole_blocks, policy)
    dst = fragmented_request(instances.decode[0], num_tokens, rng, hole_blocks, policy)
    return TransferRequest(num_tokens, src[0], src[1], dst[0], dst[1])


def staging_need(instances: Instances, requests: Sequence[TransferRequest]) -> int:
    """Staging bytes per rank that lets the packer stage what its policy wants to, for
    every request (each planned alone)."""
    policy = StagingPolicy()
    need = 0
    for request in requests:
        plans = plan_transfer(
            instances.prefill, instances.decode, request, StagingPolicy(enabled=False)
        )
        per_prefill: dict[int, int] = {}
        for plan in plans:
            per_decode = 0
            for source in plan.sources:
                small = source.wire.lengths < policy.small_bytes
                if int(small.sum()) >= policy.min_small_ranges:
                    nbytes = int(source.wire.lengths[small].sum())
                    per_decode += nbytes
                    per_prefill[source.prefill_rank] = (
                        per_prefill.get(source.prefill_rank, 0) + nbytes
                    )
            need = max(need, per_decode)
        need = max(need, *per_prefill.values(), 0)
    return need + STAGING_HEADROOM if need else 0


PLANNED_MODES = ("ours", "lowest")  # the packer's plans, on each block policy's request


@dataclass(frozen=True, eq=False)
class Transfers:
    """What each decode rank posts, per mode, for one request. `ours` and `lowest` are the
    packer's plans for the request as the contiguous and the lowest-first block pools
    placed it (the same history); raw and naive (per decode rank, a list of
    `(prefill_rank, src_offsets, dst_offsets, lengths)`) move `ours`'s bytes."""

    ours: tuple[TransferPlan, ...]
    ours_direct: tuple[TransferPlan, ...]  # the same bytes unstaged: what to verify
    raw: tuple[list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], ...]
    naive: tuple[list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], ...]
    lowest: tuple[TransferPlan, ...] = ()
    lowest_direct: tuple[TransferPlan, ...] = ()
    # Layer-wise streaming: per part (a chunk's KV of a layer group; the state with the
    # last chunk), its plans (direct, grouped layouts) and ready time.
    stream: tuple[tuple[TransferPlan, ...], ...] = ()
    stream_parts: tuple[StreamGroup, ...] = ()

    @property
    def stream_ready_s(self) -> tuple[float, ...]:
        return tuple(part.ready_s for part in self.stream_parts)

    @property
    def stream_descriptors(self) -> int:
        return sum(plan.descriptors for group in self.stream for plan in group)

    @property
    def stream_bytes(self) -> int:
        return sum(plan.wire_bytes for group in self.stream for plan in group)

    @property
    def bytes(self) -> int:
        return sum(plan.wire_bytes for plan in self.ours)

    @property
    def descriptors(self) -> int:
        return sum(plan.descriptors for plan in self.ours)

    def count(self, mode: str) -> int:
        if mode in PLANNED_MODES:
            return sum(plan.descriptors for plan in getattr(self, mode))
        return sum(len(lengths) for rank in getattr(self, mode) for *_, lengths in rank)

    def nbytes(self, mode: str) -> int:
        if mode in PLANNED_MODES:
            return sum(plan.wire_bytes for plan in getattr(self, mode))
        return sum(int(lengths.sum()) for rank in getattr(self, mode) for *_, lengths in rank)


def raw_ranges(plan: TransferPlan) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """The ceiling: the bytes this decode rank reads from each prefill rank, as one
    contiguous range each (from the start of the prefill arena, packed in the decode one)."""
    out, dst = [], 0
    for source in plan.sources:
        n = source.wire_bytes
        out.append((source.prefill_rank, np.array([0]), np.array([dst]), np.array([n])))
        dst += n
    return out


def plan_all(
    instances: Instances,
    request: TransferRequest,
    lowest: TransferRequest | None = None,
    stream: Sequence[StreamGroup] = (),
) -> Transfers:
    """Every mode's ranges for `request`; `lowest` is the same request as the lowest-first
    block pool placed it (no `lowest` mode without it); `stream`, the streaming groups of
    the modelled prefill (no stream modes without them)."""
    from transfer.bench.transfer_naive import naive_ranges

    def plans(req: TransferRequest | None) -> tuple[tuple[TransferPlan, ...], ...]:
        if req is None:
            return (), ()
        staged = plan_transfer(instances.prefill, instances.decode, req)
        direct = plan_transfer(
            instances.prefill, instances.decode, req, StagingPolicy(enabled=False)
        )
        return staged, direct

    (ours, direct), (old, old_direct) = plans(request), plans(lowest)
    naive = tuple(
        naive_ranges(instances.naive_prefill, layout, request) for layout in instances.naive_decode
    )
    direct_only = StagingPolicy(enabled=False)  # groups in flight at once share no staging
    grouped = tuple(
        plan_transfer(
            instances.stream_prefill, instances.stream_decode, request, direct_only,
            layers=group.layers, tokens=group.tokens, with_state=group.with_state,
        )
        for group in stream
    )  # fmt: skip
    return Transfers(
        ours,
        direct,
        tuple(raw_ranges(plan) for plan in ours),
        naive,
        old,
        old_direct,
        grouped,
        tuple(stream),
    )
