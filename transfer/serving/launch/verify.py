"""Check a transfer without the packer: rebuild each decode rank's cache from the prefill shards.

Each rank's view of one request is a snapshot: for every cache tensor `"L{layer}.{name}"`
a `[rows, rank_channels]` tensor whose channel axis is the tensor's segments concatenated,
each holding the rank's units in global order (what `Segment.units_on_rank` says). Rows are
the request's tokens for KV, the conv window steps for conv, one row for the recurrent state.

`assemble_global` glues the prefill snapshots back into the TP=1 cache with the geometry's
shard functions (replicas of a unit must agree bit for bit), `slice_for_rank` cuts the piece
a decode rank must hold, and `compare_snapshots` compares raw bytes. None of it reads a
layout or a transfer plan, so a packer bug cannot hide behind its own arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from transfer.geometry import CacheTensor, ModelGeometry
from transfer.serving.ranks.snapshots import RankTensors, cache_tensors, load_side
from transfer.serving.role import INSTANCE_ROLES, ServeRole


def _segment_columns(tensor: CacheTensor, tp: int, rank: int | None):
    """(segment, its first column on this side, the global units there) for each segment.

    rank None: the global (TP=1) tensor, which holds every unit.
    """
    col = 0
    for seg in tensor.segments:
        units = range(seg.num_units) if rank is None else seg.units_on_rank(tp, rank)
        yield seg, col, units
        col += len(units) * seg.unit_elems


def assemble_global(geometry: ModelGeometry, shards: Sequence[RankTensors]) -> RankTensors:
    """The TP=1 cache from the snapshots of all `len(shards)` prefill ranks.

    Raises ValueError when two ranks holding the same unit disagree, or a shape is off.
    """
    tp = len(shards)
    out: RankTensors = {}
    for key, _, tensor in cache_tensors(geometry):
        parts = [shard[key] for shard in shards]
        rows = parts[0].shape[0]
        for rank, part in enumerate(parts):
            want = (rows, tensor.rank_channels(tp))
            if tuple(part.shape) != want:
                raise ValueError(
                    f"{key}: prefill rank {rank} has shape {tuple(part.shape)}, expected {want}"
                )
        full = torch.empty((rows, tensor.channels), dtype=parts[0].dtype)
        glob = {seg.name: col for seg, col, _ in _segment_columns(tensor, 1, None)}
        for rank, part in enumerate(parts):
            for seg, col, units in _segment_columns(tensor, tp, rank):
                for i, unit in enumerate(units):
                    src = part[:, col + i * seg.unit_elems : col + (i + 1) * seg.unit_elems]
                    start = glob[seg.name] + unit * seg.unit_elems
                    holders = seg.ranks_holding(unit, tp)
                    if rank == holders[0]:
                        full[:, start : start + seg.unit_elems] = src
                    elif not _same_bytes(full[:, start : start + seg.unit_elems], src):
                        raise ValueError(
                            f"{key}: prefill ranks {holders[0]} and {rank} disagree on "
                            f"{seg.name} unit {unit}, which both hold"
                        )
        out[key] = full
    return out


def slice_for_rank(geometry: ModelGeometry, full: RankTensors, tp: int, rank: int) -> RankTensors:
    """What rank `rank` of `tp` holds of the global cache `full`."""
    out: RankTensors = {}
    for key, _, tensor in cache_tensors(geometry):
        glob = {seg.name: col for seg, col, _ in _segment_columns(tensor, 1, None)}
        cols = []
        for seg, _, units in _segment_columns(tensor, tp, rank):
            start = glob[seg.name]
            cols.append(
                full[key][
                    :, start + units.start * seg.unit_elems : start + units.stop * seg.unit_elems
                ]
            )
        out[key] = torch.cat(cols, dim=1).contiguous()
    return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def compare_snapshots(expected: RankTensors, actual: RankTensors) -> list[str]:
    """One line per tensor whose bytes differ (empty: identical)."""
    problems = []
    for key in sorted(expected.keys() | actual.keys()):
        want, got = expected.get(key), actual.get(key)
        if want is None or got is None:
            problems.append(f"{key}: missing on the {'prefill' if want is None else 'decode'} side")
        elif want.dtype != got.dtype or want.shape != got.shape:
            problems.append(
                f"{key}: expected {want.dtype} {tuple(want.shape)}, got {got.dtype} {tuple(got.shape)}"
            )
        elif not _same_bytes(want, got):
            bad = (want.view(torch.uint8) != got.view(torch.uint8)).reshape(want.shape[0], -1)
            rows = bad.any(dim=1).nonzero().flatten().tolist()
            problems.append(f"{key}: {int(bad.sum())} bytes differ, in rows {rows[:8]}")
    return problems


@dataclass(frozen=True)
class CacheCheck:
    """Outcome of check (1) for one request."""

    request_id: str
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def check_request(
    geometry: ModelGeometry,
    root: str | Path,
    request_id: str,
    prefill_tp: int,
    decode_tp: int,
) -> CacheCheck:
    """Check (1): every decode rank's cache equals the prefill caches re-sliced to it."""
    prefill = load_side(root, request_id, ServeRole.PREFILL)
    decode = load_side(root, request_id, ServeRole.DECODE)
    problems: list[str] = []
    for side, snaps, tp in zip(
        INSTANCE_ROLES, (prefill, decode), (prefill_tp, decode_tp), strict=True
    ):
        if len(snaps) != tp:
            problems.append(f"{side}: {len(snaps)} rank snapshots, expected {tp}")
    if problems:
        return CacheCheck(request_id, tuple(problems))
    try:
        full = assemble_global(geometry, prefill)
    except ValueError as exc:
        return CacheCheck(request_id, (str(exc),))
    for rank, actual in enumerate(decode):
        expected = slice_for_rank(geometry, full, decode_tp, rank)
        problems += [f"decode rank {rank}: {p}" for p in compare_snapshots(expected, actual)]
    return CacheCheck(request_id, tuple(problems))


def tokens_check(expected: Sequence[int], actual: Sequence[int]) -> str | None:
    """Check (2): None when the streamed tokens equal the colocated TP=1 run, else why not."""
    if list(expected) == list(actual):
        return None
    first = next(
        (i for i, (a, b) in enumerate(zip(expected, actual, strict=False)) if a != b),
        min(len(expected), len(actual)),
    )
    return f"tokens differ from the TP=1 reference at index {first}: expected {list(expected)}, got {list(actual)}"
