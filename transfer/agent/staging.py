"""Staging: small ranges cross as one span and land by local copies.

Two users, one set of copies:
- read-side staging (`stage_small`): when the destination scatters what the source keeps
  together (vLLM's default conv-state layout, time-major, read across TP sizes: every step
  row splits into per-head pieces), each piece would be a descriptor of its own. Small
  ranges are grouped by source offset; a group whose neighbours are at most `max_gap` bytes
  apart is read as one span into the reader's staging area, gaps included, and then copied
  piece by piece into place locally. Only the gaps cost extra bytes; only groups of two or
  more ranges are staged.
- pdxfer's packer stages on both sides: the source packs ranges back to back into its
  staging area (`gather_to_staging`), one wire range crosses, and the reader unpacks them
  (`copy_within`, which `TransferAgent` runs once a key's reads landed). Every packed copy
  is checked against the staging area first (`check_copies`), so a bad offset is refused
  naming what is wrong instead of overwriting the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import numpy as np
import torch

from transfer.cache.layout import Layout
from transfer.errors import InvalidInput

SMALL_BYTES = 64 * 1024  # ranges below this may be staged (docs/architecture.md, "Design")
MAX_GAP_BYTES = 4096  # bytes a span may read that nobody needs, between two pieces
STAGING_ALIGN = 64


@dataclass(frozen=True, eq=False)
class StagedReads:
    """Reads of one source after staging. `wire`: (local, remote, nbytes) to post, with
    staged spans at `staging offset + base`; `copies`: (staging offset, local, nbytes) to run
    once the reads landed; offsets into staging are relative to the caller's `base`."""

    wire: tuple[np.ndarray, np.ndarray, np.ndarray]
    copies: tuple[np.ndarray, np.ndarray, np.ndarray]
    staging_bytes: int
    staged_ranges: int


def _empty() -> np.ndarray:
    return np.empty(0, dtype=np.int64)


def stage_small(
    local: np.ndarray,
    remote: np.ndarray,
    nbytes: np.ndarray,
    base: int,
    small_bytes: int = SMALL_BYTES,
    max_gap: int = MAX_GAP_BYTES,
) -> StagedReads:
    """Group the small ranges of one source by remote offset into spans read into staging
    at `base` onwards (wire local offsets are `base + ...`; copy sources likewise)."""
    local, remote, nbytes = (np.asarray(a, dtype=np.int64) for a in (local, remote, nbytes))
    small = np.flatnonzero(nbytes < small_bytes)
    small = small[np.argsort(remote[small], kind="stable")]
    spans: list[list[int]] = []  # member indices
    end = None
    for i in small.tolist():
        if (
            spans
            and end is not None
            and remote[i] >= remote[spans[-1][0]]
            and remote[i] - end <= max_gap
        ):
            spans[-1].append(i)
            end = max(end, int(remote[i] + nbytes[i]))
        else:
            spans.append([i])
            end = int(remote[i] + nbytes[i])
    direct = np.ones(len(nbytes), dtype=bool)
    wire_l, wire_r, wire_n = [], [], []
    copy_s, copy_d, copy_n = [], [], []
    cursor = 0
    staged = 0
    for members in spans:
        if len(members) < 2:
            continue
        idx = np.array(members, dtype=np.int64)
        start = int(remote[idx].min())
        stop = int((remote[idx] + nbytes[idx]).max())
        direct[idx] = False
        wire_l.append(base + cursor)
        wire_r.append(start)
        wire_n.append(stop - start)
        copy_s.append(base + cursor + remote[idx] - start)
        copy_d.append(local[idx])
        copy_n.append(nbytes[idx])
        cursor += -(-(stop - start) // STAGING_ALIGN) * STAGING_ALIGN
        staged += len(members)
    wire = (
        np.concatenate([local[direct], np.array(wire_l, dtype=np.int64)]),
        np.concatenate([remote[direct], np.array(wire_r, dtype=np.int64)]),
        np.concatenate([nbytes[direct], np.array(wire_n, dtype=np.int64)]),
    )
    copies = (
        tuple(np.concatenate(c) for c in (copy_s, copy_d, copy_n))
        if copy_s
        else (_empty(), _empty(), _empty())
    )
    return StagedReads(wire, copies, cursor, staged)


class CopyColumns(Protocol):
    """Copies inside one arena as int64 columns of offsets (`transfer.serving.ranks.spec.Copies`)."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int: ...


class Packed(Enum):
    """Which side of a copy is the packed (staging) one."""

    SRC = "src"  # unpacking: staging -> cache
    DST = "dst"  # packing: cache -> staging


@dataclass(frozen=True)
class StagingArea:
    """Where packed bytes may lie (`[start, end)`), and where cache ranges must end
    (`cache_end`: the cache regions are `[0, cache_end)`) in one rank's arena."""

    start: int
    end: int
    cache_end: int

    @classmethod
    def of(cls, layout: Layout) -> StagingArea:
        start = layout.staging_offset
        return cls(start, start + layout.staging_bytes, layout.progress_offset)


def check_copies(area: StagingArea, copies: CopyColumns, packed: Packed) -> tuple[int, int]:
    """(start, bytes) of the packed side, which must be back to back inside the staging
    area; the other side must lie in the cache regions. InvalidInput names what is wrong."""
    lengths = copies.nbytes
    packed_at = copies.dst if packed is Packed.DST else copies.src
    cache_at = copies.src if packed is Packed.DST else copies.dst
    if (lengths < 1).any():
        raise InvalidInput("staging copies: every length must be >= 1")
    start, total = int(packed_at[0]), int(lengths.sum())
    if not _back_to_back(packed_at, lengths):
        raise InvalidInput(f"staging copies: {packed.value} offsets are not back to back")
    if start < area.start or start + total > area.end:
        raise InvalidInput(
            f"staging copies: [{start}, {start + total}) outside staging ({area.start}, {area.end})"
        )
    if (cache_at < 0).any() or (cache_at + lengths > area.cache_end).any():
        raise InvalidInput("staging copies: a cache range lies outside the cache regions")
    return start, total


def _back_to_back(offsets: np.ndarray, lengths: np.ndarray) -> bool:
    expected = offsets[0] + np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return bool(np.array_equal(offsets, expected))


def gather_to_staging(buffer: torch.Tensor, area: StagingArea, copies: CopyColumns) -> None:
    """Pack cache ranges of `buffer` (uint8 [arena bytes]) back to back into its staging
    area (`copies.dst` consecutive); done when this returns."""
    if not len(copies):
        return
    from kernels import gather_ranges

    start, total = check_copies(area, copies, Packed.DST)
    src, lengths = torch.from_numpy(copies.src), torch.from_numpy(copies.nbytes)
    gather_ranges(buffer, src, lengths, out=buffer[start : start + total])
    if buffer.is_cuda:
        torch.cuda.synchronize(buffer.device)


def copy_within(buffer: torch.Tensor, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
    """Copy `nbytes[i]` from `src[i]` to `dst[i]` inside `buffer` (uint8 [arena bytes]):
    each run of packed sources (back to back) in one `kernels.scatter_ranges`."""
    if not len(nbytes):
        return
    from kernels import scatter_ranges

    src, dst, nbytes = (np.asarray(a, dtype=np.int64) for a in (src, dst, nbytes))
    breaks = np.flatnonzero(src[1:] != src[:-1] + nbytes[:-1]) + 1
    for run_src, run_dst, run_nbytes in zip(
        np.split(src, breaks), np.split(dst, breaks), np.split(nbytes, breaks), strict=True
    ):
        start, total = int(run_src[0]), int(run_nbytes.sum())
        dst_t, lengths = torch.from_numpy(run_dst.copy()), torch.from_numpy(run_nbytes.copy())
        scatter_ranges(buffer[start : start + total], buffer, dst_t, lengths)
