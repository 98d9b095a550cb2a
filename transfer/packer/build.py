"""`plan_transfer`: coalesce each decode rank's copies, and stage the many small ones."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from transfer.cache.layout import Layout
from transfer.errors import InvalidInput
from transfer.packer.pairs import instance_pair
from transfer.packer.pieces import merge_neighbours, request_indices, request_pieces
from transfer.packer.plan import Mode, Ranges, SourcePlan, StagingWindow, TransferPlan
from transfer.packer.request import TransferRequest, validate_request
from transfer.units import format_bytes


@dataclass(frozen=True)
class StagingPolicy:
    """When to stage: a source with at least `min_small_ranges` ranges under `small_bytes`
    gathers those into its staging area and sends them as one range; larger ranges stay
    direct. (NIXL on 2 cores: 3.08 GB/s as one descriptor, 2.11 as 64 KiB pieces, 1.11 as
    16 KiB pieces; docs/architecture.md, "Design".)"""

    enabled: bool = True
    small_bytes: int = 64 * 1024
    min_small_ranges: int = 32

    def __post_init__(self) -> None:
        for field in ("small_bytes", "min_small_ranges"):
            if getattr(self, field) < 1:
                raise InvalidInput(
                    f"staging policy {field} must be >= 1, got {getattr(self, field)}"
                )


def coalesce(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> Ranges:
    """Merge neighbours that are adjacent on both sides. Input is in destination order for
    wire ranges, staging order for gather/scatter ranges."""
    return Ranges(*merge_neighbours(src, dst, lengths))


def _direct(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> Ranges:
    order = np.argsort(dst, kind="stable")
    src, dst, lengths = src[order], dst[order], lengths[order]
    if len(dst) > 1 and (dst[:-1] + lengths[:-1] > dst[1:]).any():
        raise AssertionError("packer produced overlapping destination ranges")
    return coalesce(src, dst, lengths)


class _StagingCursor:
    """Staging bytes handed out so far, per prefill rank and per decode rank."""

    def __init__(self) -> None:
        self.prefill: dict[int, int] = defaultdict(int)
        self.decode: dict[int, int] = defaultdict(int)


def _source_plan(
    rank: int,
    direct: Ranges,
    kv_bytes: int,
    state_bytes: int,
    p_layout: Layout,
    d_layout: Layout,
    policy: StagingPolicy,
    cursor: _StagingCursor,
    p_window: StagingWindow,
    d_window: StagingWindow,
) -> SourcePlan:
    def plan(wire: Ranges, gather: Ranges, scatter: Ranges, mode: Mode, reason: str) -> SourcePlan:
        return SourcePlan(
            rank, wire, gather, scatter, kv_bytes, state_bytes, len(direct), mode, reason
        )

    small = direct.lengths < policy.small_bytes
    n_small = int(small.sum())
    limit = format_bytes(policy.small_bytes)
    if not policy.enabled or n_small < policy.min_small_ranges:
        why = (
            "staging disabled"
            if not policy.enabled
            else (f"{n_small} under {limit}, staging needs {policy.min_small_ranges}")
        )
        return plan(
            direct,
            Ranges.empty(),
            Ranges.empty(),
            Mode.DIRECT,
            f"direct: {len(direct)} ranges ({why})",
        )
    src, dst, lengths = direct.src[small], direct.dst[small], direct.lengths[small]
    total = int(lengths.sum())
    p_at, d_at = cursor.prefill[rank], cursor.decode[d_layout.rank]
    if p_at + total > p_window.nbytes or d_at + total > d_window.nbytes:
        return plan(
            direct,
            Ranges.empty(),
            Ranges.empty(),
            Mode.DIRECT,
            f"direct: {len(direct)} ranges; staging its {n_small} under {limit} needs "
            f"{format_bytes(total)}, free: prefill {format_bytes(p_window.nbytes - p_at)}, "
            f"decode {format_bytes(d_window.nbytes - d_at)}",
        )
    cursor.prefill[rank] += total
    cursor.decode[d_layout.rank] += total
    within = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    p_stage = p_layout.staging_offset + p_window.offset + p_at
    d_stage = d_layout.staging_offset + d_window.offset + d_at
    gather = coalesce(src, p_stage + within, lengths)
    scatter = coalesce(d_stage + within, dst, lengths)
    large = ~small
    wire = Ranges(
        np.append(direct.src[large], p_stage),
        np.append(direct.dst[large], d_stage),
        np.append(direct.lengths[large], total),
    )
    mode = Mode.MIXED if large.any() else Mode.STAGED
    reason = (
        f"{mode.value}: {n_small} of {len(direct)} ranges under {limit} "
        f"({format_bytes(total)}) gathered into 1 wire range"
    )
    if large.any():
        reason += f"; {int(large.sum())} larger ranges direct"
    return plan(wire, gather, scatter, mode, reason)


def plan_transfer(
    prefill: Sequence[Layout],
    decode: Sequence[Layout],
    request: TransferRequest,
    policy: StagingPolicy | None = None,
    prefill_window: StagingWindow | None = None,
    decode_window: StagingWindow | None = None,
    layers: Collection[int] | None = None,
    tokens: tuple[int, int] | None = None,
    with_state: bool = True,
) -> tuple[TransferPlan, ...]:
    """One `TransferPlan` per decode rank for `request`.

    `prefill` / `decode`: one layout per rank, in rank order. Raises InvalidInput naming the
    field for bad input (nothing is planned). Staged bytes go back to back into each side's
    window (default: the whole staging area), so plans with disjoint windows may run at
    once; the plans of one call never overlap each other. `layers` (model layer indices;
    None: all) plans only those layers' KV and state: one group of a layer-wise stream.
    `tokens` (`[start, end)`) limits the KV to those tokens (one chunk of a chunked
    prefill), and `with_state=False` leaves the state out (it is final only after the
    last chunk). `useful_bytes` is then what the part holds.
    """
    prefill, decode = tuple(prefill), tuple(decode)
    pair = instance_pair(prefill, decode)  # validates the layouts
    validate_request(prefill[0], decode[0], request)
    policy = policy or StagingPolicy()
    p_window = prefill_window or StagingWindow(0, prefill[0].staging_bytes)
    d_window = decode_window or StagingWindow(0, decode[0].staging_bytes)
    p_window.check(prefill[0].staging_bytes, "prefill_window")
    d_window.check(decode[0].staging_bytes, "decode_window")
    wanted = None if layers is None else _check_layers(layers, decode[0])
    if tokens is not None:
        start, end = tokens
        if not 0 <= start <= end <= request.num_tokens:
            raise InvalidInput(
                f"tokens: [{start}, {end}) is not a range of the request's "
                f"{request.num_tokens} tokens"
            )
    cursor = _StagingCursor()
    plans = []
    at = request_indices(request, prefill[0].block_size, decode[0].block_size, tokens)
    ranks = pair.rank_copies(wanted, with_state)
    for d_layout, copies in zip(decode, ranks, strict=True):
        sources = tuple(
            _source_plan(
                p,
                _direct(piece.src, piece.dst, piece.lengths),
                piece.kv_bytes,
                piece.state_bytes,
                prefill[p],
                d_layout,
                policy,
                cursor,
                p_window,
                d_window,
            )
            for p, piece in request_pieces(copies, at).items()
        )
        useful = copies.kv_bytes_per_token * at.num_tokens
        useful += copies.state_bytes_per_slot * len(request.dst_slots) if with_state else 0
        naive = copies.kv_tensor_sources * len(request.dst_blocks)
        naive += copies.state_tensor_sources * len(request.dst_slots)
        plans.append(TransferPlan(d_layout.rank, request.num_tokens, sources, useful, naive))
    return tuple(plans)


def naive_descriptors(plans: Sequence[TransferPlan]) -> int:
    """What posting one descriptor per (layer, block, K/V region) and per (state tensor,
    slot), per source rank, would take for these plans, as vLLM's NixlConnector does."""
    return sum(plan.naive_descriptors for plan in plans)


def _check_layers(layers: Collection[int], layout: Layout) -> frozenset[int]:
    known = {layer.index for layer in layout.geometry.layers}
    wanted = frozenset(layers)
    unknown = sorted(wanted - known)
    if unknown or not wanted:
        raise InvalidInput(
            f"layers: {unknown or 'none given'}: not cache-bearing layers of "
            f"{layout.geometry.name} ({min(known)}..{max(known)})"
        )
    return wanted


def staging_extents(plans: Sequence[TransferPlan]) -> tuple[int, int]:
    """(prefill, decode): the staging bytes `plans` pack on the busiest rank of each side,
    i.e. the window each side needs."""
    prefill: dict[int, int] = defaultdict(int)
    decode: dict[int, int] = defaultdict(int)
    for plan in plans:
        for source in plan.sources:
            prefill[source.prefill_rank] += source.gather.nbytes
            decode[plan.decode_rank] += source.scatter.nbytes
    return max(prefill.values(), default=0), max(decode.values(), default=0)


def prefill_gathers(plans: Sequence[TransferPlan], num_prefill_ranks: int) -> tuple[Ranges, ...]:
    """Per prefill rank, its gather ranges of every plan in staging order. Packed back to
    back from its window's start, they land exactly where the plans put them."""
    per_rank: list[list[Ranges]] = [[] for _ in range(num_prefill_ranks)]
    for plan in plans:
        for source in plan.sources:
            if len(source.gather):
                per_rank[source.prefill_rank].append(source.gather)
    out = []
    for parts in per_rank:
        if not parts:
            out.append(Ranges.empty())
            continue
        src, dst, lengths = (
            np.concatenate(columns) for columns in zip(*(p.arrays() for p in parts), strict=True)
        )
        order = np.argsort(dst, kind="stable")
        src, dst, lengths = src[order], dst[order], lengths[order]
        if (dst[1:] != dst[:-1] + lengths[:-1]).any():
            raise AssertionError("packer left a gap between staged ranges")
        out.append(Ranges(src, dst, lengths))
    return tuple(out)
