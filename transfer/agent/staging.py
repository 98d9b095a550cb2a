"""A rank's staging copies: pack cache ranges into its staging area (the source side, before
the peer READs them) and unpack staged bytes into the cache (the reading side, once they
landed). Every copy is checked against the staging area's bounds first, so a bad offset is
refused naming what is wrong instead of overwriting the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch

from transfer.cache.layout import Layout
from transfer.errors import InvalidInput


@dataclass(frozen=True, eq=False)
class Copies:
    """Copies inside one rank's arena, as int64 columns of offsets: `src`, `dst`, `nbytes`.
    A staging gather has consecutive `dst`s, a staging scatter consecutive `src`s."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)

    @classmethod
    def empty(cls) -> Copies:
        none = np.empty(0, dtype=np.int64)
        return cls(none, none, none)


class Packed(Enum):
    """Which side of a copy is the packed (staging) one."""

    SRC = "src"  # a scatter: staging -> cache
    DST = "dst"  # a gather: cache -> staging


@dataclass(frozen=True)
class StagingArea:
    """Where staged bytes may lie (`[start, end)`), and where cache ranges must end
    (`cache_end`: the cache regions are `[0, cache_end)`) in one rank's arena."""

    start: int
    end: int
    cache_end: int

    @classmethod
    def of(cls, layout: Layout) -> StagingArea:
        start = layout.staging_offset
        return cls(start, start + layout.staging_bytes, layout.progress_offset)


def check_copies(area: StagingArea, copies: Copies, packed: Packed) -> tuple[int, int]:
    """(start, bytes) of the packed side, which must be back to back inside the staging
    area; the other side must lie in the cache regions. InvalidInput names what is wrong."""
    lengths = copies.nbytes
    packed_at = copies.dst if packed is Packed.DST else copies.src
    cache_at = copies.src if packed is Packed.DST else copies.dst
    if (lengths < 1).any():
        raise InvalidInput("staging copies: every length must be >= 1")
    start, total = int(packed_at[0]), int(lengths.sum())
    expected = start + np.concatenate(([0], np.cumsum(lengths)[:-1]))
    if not np.array_equal(packed_at, expected):
        raise InvalidInput(f"staging copies: {packed.value} offsets are not back to back")
    if start < area.start or start + total > area.end:
        raise InvalidInput(
            f"staging copies: [{start}, {start + total}) outside staging ({area.start}, {area.end})"
        )
    if (cache_at < 0).any() or (cache_at + lengths > area.cache_end).any():
        raise InvalidInput("staging copies: a cache range lies outside the cache regions")
    return start, total


def gather_to_staging(buffer: torch.Tensor, area: StagingArea, copies: Copies) -> None:
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


def scatter_from_staging(buffer: torch.Tensor, area: StagingArea, copies: Copies) -> None:
    """Unpack staged bytes of `buffer` (`copies.src` consecutive) into the cache ranges
    `copies.dst`."""
    if not len(copies):
        return
    from kernels import scatter_ranges

    start, total = check_copies(area, copies, Packed.SRC)
    dst, lengths = torch.from_numpy(copies.dst), torch.from_numpy(copies.nbytes)
    scatter_ranges(buffer[start : start + total], buffer, dst, lengths)
