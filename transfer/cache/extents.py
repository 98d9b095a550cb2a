"""Free KV blocks kept as extents (runs of consecutive ids), for contiguity-aware allocation.

Why: the packer coalesces a request's byte ranges, so its descriptor count is the number
of block runs the request was handed (per region). Lowest-free-first allocation hands a
request whatever holes lie lowest; this allocator hands it the fewest runs the free set
allows.

Policy, for `take(n)`:
- when one free run holds all `n` blocks, take the head of the *smallest* such run (best
  fit): small requests fill small holes and leave the large runs whole for large requests;
- otherwise take whole runs, *largest first*, until the remainder fits one run, then
  best-fit the remainder. Largest-first is the fewest runs any allocator could use on this
  free set: no k runs hold more blocks than the k largest.

Both orders live in sorted containers (by start, to coalesce neighbours on free; by
length then start, to find the best fit), so every operation is O(log n) in the number of
extents, whatever the pool size.

Seam for a prefix cache: blocks whose refcount dropped to zero but that a prefix cache
still indexes are not free here; the cache keeps them in its own LRU and `put`s them back
when it evicts them. The two orders never share an entry, so neither can go stale.
"""

from __future__ import annotations

from collections.abc import Iterable

from sortedcontainers import SortedDict, SortedList

from transfer.errors import InvalidInput


def count_runs(ids: Iterable[int]) -> int:
    """Runs of consecutive ids in `ids`, in the order given (a block table's descriptors)."""
    runs, previous = 0, None
    for i in ids:
        if previous is None or i != previous + 1:
            runs += 1
        previous = i
    return runs


class FreeExtents:
    """The free ids of a pool of `size` ids as maximal runs; all free at start."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._by_start: SortedDict = SortedDict()  # start -> length
        self._by_length: SortedList = SortedList()  # (length, start)
        self.num_free = 0
        if size:
            self._insert(0, size)

    @property
    def num_runs(self) -> int:
        return len(self._by_start)

    def runs(self) -> list[tuple[int, int]]:
        """(start, length) of every free run, by start."""
        return list(self._by_start.items())

    def largest_run(self) -> int:
        return self._by_length[-1][0] if self._by_length else 0

    def take(self, n: int) -> list[int]:
        """`n` free ids in as few runs as possible (see the module docstring); all or nothing."""
        if n < 0 or n > self.num_free:
            raise InvalidInput(f"take: {n} ids requested, {self.num_free} free")
        ids: list[int] = []
        remaining = n
        while remaining:
            fit = self._by_length.bisect_left((remaining, -1))
            if fit < len(self._by_length):
                length, start = self._by_length[fit]
            else:
                length, start = self._by_length[-1]
            used = min(length, remaining)
            self._remove(start, length)
            if used < length:
                self._insert(start + used, length - used)
            ids.extend(range(start, start + used))
            remaining -= used
        return ids

    def put(self, ids: Iterable[int]) -> None:
        """Return ids (not free, in range: the caller checked) and merge them with their
        neighbours, so the runs stay maximal."""
        for start, length in _runs_of(sorted(ids)):
            self._put_run(start, length)

    def _put_run(self, start: int, length: int) -> None:
        end = start + length
        after = self._by_start.get(end)
        if after is not None:
            self._remove(end, after)
            end += after
        before = self._by_start.bisect_left(start) - 1
        if before >= 0:
            prev_start = self._by_start.keys()[before]
            prev_length = self._by_start[prev_start]
            if prev_start + prev_length == start:
                self._remove(prev_start, prev_length)
                start = prev_start
        self._insert(start, end - start)

    def _insert(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_length.add((length, start))
        self.num_free += length

    def _remove(self, start: int, length: int) -> None:
        del self._by_start[start]
        self._by_length.remove((length, start))
        self.num_free -= length


def _runs_of(sorted_ids: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i in sorted_ids:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
