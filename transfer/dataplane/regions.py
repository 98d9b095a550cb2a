"""`RegionMap`: several registered memory regions seen as one offset space.

An engine that owns its memory (vLLM's KV cache, a separate staging buffer) cannot hand
pdxfer one arena. Its regions are then placed in a virtual offset space, region `i` at
`starts[i]`, with a gap of at least `REGION_GAP` bytes between neighbours. Layouts and the
packer work in that space unchanged; the transport turns each range into an address inside
one region. The gap means no coalesced range can run from one region into the next, and a
range that would is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from transfer.errors import InvalidInput

REGION_GAP = 4096  # virtual bytes between regions; also their alignment


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


@dataclass(frozen=True)
class Region:
    """`nbytes` of memory at `address`, at virtual offset `start`."""

    start: int
    address: int
    nbytes: int


@dataclass(frozen=True)
class RegionMap:
    """Regions sorted by virtual start; `extent` is the virtual size (the arena size the
    transport checks ranges against)."""

    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        if not self.regions:
            raise InvalidInput("regions: at least one region is needed")
        end = -1
        for i, region in enumerate(self.regions):
            if region.nbytes <= 0 or region.address < 0 or region.start < 0:
                raise InvalidInput(f"regions[{i}]: needs nbytes > 0, address and start >= 0")
            if region.start <= end:
                raise InvalidInput(
                    f"regions[{i}]: starts at {region.start}, inside its predecessor"
                )
            end = region.start + region.nbytes

    @classmethod
    def place(cls, spans: Sequence[tuple[int, int]]) -> RegionMap:
        """Lay `(address, nbytes)` spans out in the given order, each aligned to
        `REGION_GAP` and at least `REGION_GAP` bytes after the previous one's end."""
        regions = []
        cursor = 0
        for address, nbytes in spans:
            regions.append(Region(cursor, int(address), int(nbytes)))
            cursor = _align(cursor + int(nbytes), REGION_GAP) + REGION_GAP
        return cls(tuple(regions))

    @property
    def extent(self) -> int:
        last = self.regions[-1]
        return last.start + last.nbytes

    def to_list(self) -> list[list[int]]:
        return [[r.start, r.address, r.nbytes] for r in self.regions]

    @classmethod
    def from_list(cls, rows: object, field: str = "regions") -> RegionMap:
        if not isinstance(rows, list | tuple) or not rows:
            raise InvalidInput(f"{field}: expected a non-empty list of [start, address, nbytes]")
        regions = []
        for i, row in enumerate(rows):
            if (
                not isinstance(row, list | tuple)
                or len(row) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in row)
            ):
                raise InvalidInput(f"{field}[{i}]: expected [start, address, nbytes] integers")
            regions.append(Region(*row))
        return cls(tuple(regions))

    def find(self, offset: int) -> Region:
        """The region holding virtual `offset`."""
        index = self.indices(np.array([offset]), np.array([1]), "offset")[0]
        return self.regions[int(index)]

    def find_address(self, address: int) -> Region:
        """The region holding absolute `address`."""
        for region in self.regions:
            if region.address <= address < region.address + region.nbytes:
                return region
        raise InvalidInput(f"address {address:#x}: in no registered region")

    def indices(self, offsets: np.ndarray, nbytes: np.ndarray, field: str) -> np.ndarray:
        """Region index of each range; InvalidInput names the first range that is not
        wholly inside one region."""
        starts = np.fromiter((r.start for r in self.regions), dtype=np.int64)
        ends = starts + np.fromiter((r.nbytes for r in self.regions), dtype=np.int64)
        index = np.searchsorted(starts, offsets, side="right") - 1
        bad = (index < 0) | (offsets + nbytes > ends[np.maximum(index, 0)])
        if bad.any():
            i = int(np.argmax(bad))
            raise InvalidInput(
                f"{field}[{i}]: [{int(offsets[i])}, {int(offsets[i] + nbytes[i])}) is not "
                "inside one registered region (a range may not cross a region boundary)"
            )
        return index

    def addresses(self, offsets: np.ndarray, nbytes: np.ndarray, field: str) -> np.ndarray:
        """Absolute addresses (int64) of ranges given in virtual offsets."""
        index = self.indices(offsets, nbytes, field)
        starts = np.fromiter((r.start for r in self.regions), dtype=np.int64)
        bases = np.fromiter((r.address for r in self.regions), dtype=np.int64)
        return offsets - starts[index] + bases[index]
