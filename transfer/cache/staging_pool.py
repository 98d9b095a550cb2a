"""`StagingPool`: contiguous extents of a staging area, one per staged transfer.

A staged transfer packs its small ranges back to back, so it needs one contiguous extent
on every rank of an instance, at the same offset on each. The area is cut into pages and
the free pages are kept as extents (`FreeExtents`), so an allocation is the best-fitting
free run, frees coalesce, and a transfer that finds no run long enough gets None and
goes direct instead: staging is an optimisation, never a reason to fail a request.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

from transfer.cache.extents import FreeExtents
from transfer.errors import InvalidInput, WrongState

PAGE_BYTES = 4096


class StagingPool:
    """Extents of a staging area of `area_bytes`; the first `reserved_bytes` are never
    handed out (the handshake's warm-up READ lands there). Offsets are into the area.
    Thread-safe."""

    def __init__(self, area_bytes: int, reserved_bytes: int = 0, page_bytes: int = PAGE_BYTES):
        for name, value, low in (
            ("area_bytes", area_bytes, 0),
            ("reserved_bytes", reserved_bytes, 0),
            ("page_bytes", page_bytes, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidInput(f"{name}: must be an integer >= {low}, got {value!r}")
        self.page_bytes = page_bytes
        self.base = -(-reserved_bytes // page_bytes) * page_bytes
        self.num_pages = max(0, area_bytes - self.base) // page_bytes
        self._free = FreeExtents(self.num_pages)
        self._held: dict[Hashable, tuple[int, int]] = {}  # key -> (first page, pages)
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free.num_free * self.page_bytes

    @property
    def largest_free_bytes(self) -> int:
        """The longest extent `allocate` could hand out now."""
        with self._lock:
            return self._free.largest_run() * self.page_bytes

    def allocate(self, key: Hashable, nbytes: int) -> int | None:
        """The offset of a free extent of at least `nbytes`, now held by `key`; None when no
        free run is that long."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise InvalidInput(f"nbytes: must be >= 1, got {nbytes}")
        pages = -(-nbytes // self.page_bytes)
        with self._lock:
            if key in self._held:
                raise WrongState(f"staging: {key!r} already holds an extent")
            if self._free.largest_run() < pages:
                return None
            taken = self._free.take(pages)  # one run: the largest run holds it
            self._held[key] = (taken[0], pages)
        return self.base + taken[0] * self.page_bytes

    def free(self, key: Hashable) -> bool:
        """Give `key`'s extent back; False when it holds none."""
        with self._lock:
            held = self._held.pop(key, None)
            if held is not None:
                first, pages = held
                self._free.put(range(first, first + pages))
        return held is not None

    def holds(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._held
