"""`RangeBatch`: the byte ranges of one transfer, as three int64 columns."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from transfer.errors import InvalidInput


def _column(values: object, field: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise InvalidInput(f"ranges.{field}: expected a 1-D array, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise InvalidInput(f"ranges.{field}: expected integers, got dtype {array.dtype}")
    if array.dtype.kind == "u" and array.size and array.max() > np.iinfo(np.int64).max:
        raise InvalidInput(f"ranges.{field}: values exceed int64")
    column = np.ascontiguousarray(array, dtype=np.int64).copy()
    column.flags.writeable = False
    return column


@dataclass(frozen=True, eq=False)
class RangeBatch:
    """Ranges `(local[i], remote[i], nbytes[i])`: byte offsets into the local arena and the
    peer's arena, and lengths. All three are read-only int64 arrays of shape [n].

    Offsets are 64-bit end to end. Destination ranges of one batch must not overlap.
    """

    local: np.ndarray
    remote: np.ndarray
    nbytes: np.ndarray

    def __post_init__(self) -> None:
        for field in ("local", "remote", "nbytes"):
            object.__setattr__(self, field, _column(getattr(self, field), field))
        if not len(self.local) == len(self.remote) == len(self.nbytes):
            raise InvalidInput(
                "ranges: local, remote and nbytes differ in length "
                f"({len(self.local)}, {len(self.remote)}, {len(self.nbytes)})"
            )
        if len(self.local) == 0:
            raise InvalidInput("ranges: empty batch")
        for field in ("local", "remote"):
            if getattr(self, field).min() < 0:
                raise InvalidInput(f"ranges.{field}: negative offset")
        if self.nbytes.min() <= 0:
            raise InvalidInput("ranges.nbytes: every range needs at least one byte")
        for field in ("local", "remote"):
            if (getattr(self, field) > np.iinfo(np.int64).max - self.nbytes).any():
                raise InvalidInput(f"ranges.{field}: offset + nbytes overflows int64")

    @classmethod
    def of(cls, triples: Iterable[tuple[int, int, int]]) -> RangeBatch:
        """From `(local, remote, nbytes)` triples."""
        rows = np.asarray(list(triples), dtype=np.int64).reshape(-1, 3)
        return cls(rows[:, 0], rows[:, 1], rows[:, 2])

    @classmethod
    def single(cls, local: int, remote: int, nbytes: int) -> RangeBatch:
        return cls(np.array([local]), np.array([remote]), np.array([nbytes]))

    def __len__(self) -> int:
        return len(self.nbytes)

    def __repr__(self) -> str:
        return f"RangeBatch(n={len(self)}, total_bytes={self.total_bytes})"

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def check_within(self, local_bytes: int, remote_bytes: int) -> None:
        """Raise InvalidInput naming the column if a range leaves its arena."""
        for field, size in (("local", local_bytes), ("remote", remote_bytes)):
            ends = getattr(self, field) + self.nbytes
            worst = int(np.argmax(ends))
            if ends[worst] > size:
                raise InvalidInput(
                    f"ranges.{field}[{worst}]: range ends at byte {int(ends[worst])}, "
                    f"past the {field} arena of {size} bytes"
                )

    def swapped(self) -> RangeBatch:
        """The same ranges seen from the peer: local and remote exchanged."""
        return RangeBatch(self.remote, self.local, self.nbytes)

    def coalesced(self) -> RangeBatch:
        """Merge each range into its predecessor when both sides continue it exactly."""
        if len(self) == 1:
            return self
        follows = (self.local[:-1] + self.nbytes[:-1] == self.local[1:]) & (
            self.remote[:-1] + self.nbytes[:-1] == self.remote[1:]
        )
        if not follows.any():
            return self
        starts = np.flatnonzero(np.concatenate(([True], ~follows)))
        return RangeBatch(
            self.local[starts], self.remote[starts], np.add.reduceat(self.nbytes, starts)
        )
