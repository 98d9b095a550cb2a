"""The old KV block allocator: lowest free id first (kept so the benchmark can compare)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Protocol


class FreeIds(Protocol):
    """A free list: which free ids to hand out (the caller checks counts and ranges)."""

    num_free: int

    def take(self, n: int) -> list[int]: ...

    def put(self, ids: Iterable[int]) -> None: ...


class LowestFree:
    """Free ids 0..n-1, lowest first: freed ids in a heap, never-used ids above `_fresh`."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._heap: list[int] = []
        self._fresh = 0
        self.num_free = size

    def take(self, n: int) -> list[int]:
        ids = [heapq.heappop(self._heap) for _ in range(min(n, len(self._heap)))]
        fresh = n - len(ids)
        ids.extend(range(self._fresh, self._fresh + fresh))
        self._fresh += fresh
        self.num_free -= n
        return ids

    def put(self, ids: Iterable[int]) -> None:
        for i in ids:
            heapq.heappush(self._heap, i)
            self.num_free += 1
