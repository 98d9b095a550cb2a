"""What the packer returns: per decode rank, coalesced byte ranges per source prefill rank."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from transfer.errors import InvalidInput


def _int64(values: Any) -> np.ndarray:
    array = np.array(values, dtype=np.int64)  # a private copy, so read-only is safe
    array.flags.writeable = False
    return array


@dataclass(frozen=True, eq=False)
class Ranges:
    """Copies `(src[i], dst[i], lengths[i])`: read-only int64 arrays of shape [n]."""

    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray

    def __post_init__(self) -> None:
        for field in ("src", "dst", "lengths"):
            object.__setattr__(self, field, _int64(getattr(self, field)))
        if not len(self.src) == len(self.dst) == len(self.lengths):
            raise InvalidInput("ranges: src, dst and lengths differ in length")

    @classmethod
    def empty(cls) -> Ranges:
        return cls(np.empty(0), np.empty(0), np.empty(0))

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(src_offsets, dst_offsets, lengths)`, int64, for a transport or the pack kernels."""
        return self.src, self.dst, self.lengths

    def entries(self) -> Iterator[tuple[int, int, int]]:
        yield from zip(self.src.tolist(), self.dst.tolist(), self.lengths.tolist(), strict=True)


@dataclass(frozen=True)
class StagingWindow:
    """The part of every rank's staging area that one plan may pack into: `nbytes` from
    `offset` bytes into the area (the same offset on every rank of an instance)."""

    offset: int
    nbytes: int

    def check(self, staging_bytes: int, field: str) -> None:
        """Raise InvalidInput naming `field` unless the window lies inside an area of
        `staging_bytes`."""
        for name in ("offset", "nbytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidInput(f"{field}.{name}: must be an integer >= 0, got {value!r}")
        if self.offset + self.nbytes > staging_bytes:
            raise InvalidInput(
                f"{field}: [{self.offset}, {self.offset + self.nbytes}) exceeds the staging "
                f"area of {staging_bytes} bytes"
            )


class Mode(str, enum.Enum):
    DIRECT = "direct"  # every range goes on the wire as it is
    STAGED = "staged"  # all ranges are gathered into staging: one wire range
    MIXED = "mixed"  # small ranges staged (one wire range), large ones direct


@dataclass(frozen=True, eq=False)
class SourcePlan:
    """Everything one decode rank reads from one prefill rank.

    Staged bytes move in three steps: the prefill rank runs `gather` (its arena -> its
    staging area, `kernels.gather_ranges`), the transport posts `wire`, the decode rank
    runs `scatter` (its staging area -> its arena, `kernels.scatter_ranges`). Direct bytes
    are just `wire` ranges. All offsets are arena offsets.
    """

    prefill_rank: int
    wire: Ranges  # src: prefill arena, dst: decode arena
    gather: Ranges  # src: prefill arena, dst: prefill staging (consecutive)
    scatter: Ranges  # src: decode staging (consecutive), dst: decode arena
    kv_bytes: int
    state_bytes: int
    direct_descriptors: int  # what a direct-only plan would post
    mode: Mode
    reason: str

    @property
    def descriptors(self) -> int:
        return len(self.wire)

    @property
    def wire_bytes(self) -> int:
        return self.wire.nbytes

    @property
    def useful_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """The transfer plan of one decode rank for one request."""

    decode_rank: int
    num_tokens: int
    sources: tuple[SourcePlan, ...]
    useful_bytes: int  # what a TP=D run holds for this request on this rank
    naive_descriptors: int  # one per (layer, block, K/V region) per source, as NixlConnector

    @property
    def kv_bytes(self) -> int:
        return sum(s.kv_bytes for s in self.sources)

    @property
    def state_bytes(self) -> int:
        return sum(s.state_bytes for s in self.sources)

    @property
    def wire_bytes(self) -> int:
        return sum(s.wire_bytes for s in self.sources)

    @property
    def descriptors(self) -> int:
        return sum(s.descriptors for s in self.sources)

    def source(self, prefill_rank: int) -> SourcePlan:
        for source in self.sources:
            if source.prefill_rank == prefill_rank:
                return source
        raise InvalidInput(
            f"decode rank {self.decode_rank} reads nothing from prefill rank {prefill_rank}"
        )

    def ranges(self) -> Iterator[tuple[int, int, int, int]]:
        """`(prefill_rank, src_offset, dst_offset, nbytes)` for every wire range."""
        for source in self.sources:
            for s, d, n in source.wire.entries():
                yield source.prefill_rank, s, d, n

    def report(self) -> dict[str, Any]:
        """This rank's entry in `pdxfer plan --transfer --json` (keys are a public interface)."""
        return {
            "rank": self.decode_rank,
            "kv_bytes": self.kv_bytes,
            "state_bytes": self.state_bytes,
            "useful_bytes": self.useful_bytes,
            "wire_bytes": self.wire_bytes,
            "descriptors": self.descriptors,
            "naive_descriptors": self.naive_descriptors,
            "sources": [
                {
                    "prefill_rank": s.prefill_rank,
                    "bytes": s.wire_bytes,
                    "descriptors": s.descriptors,
                    "kv_bytes": s.kv_bytes,
                    "state_bytes": s.state_bytes,
                    "mode": s.mode.value,
                    "direct_descriptors": s.direct_descriptors,
                    "gather_ranges": len(s.gather),
                    "scatter_ranges": len(s.scatter),
                    "reason": s.reason,
                }
                for s in self.sources
            ],
        }
