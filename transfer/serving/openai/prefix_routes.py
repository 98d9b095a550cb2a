"""Prefix-aware routing: send a request to the instance that holds the longest cached prefix
of its prompt, unless that instance is busier than the others by more than `max_skew`.

The router learns which instance holds which blocks from what passes through it: the
tickets' block hashes (chained, so a hash names the whole prefix up to its block), recorded
against the prefill instance that wrote them and the decode instance that read them. It
never asks an instance for token ids or its cache contents. A hint can be stale (evicted
since, or an instance running without its cache); that costs a miss, not a wrong answer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from transfer.cache.block_hashes import block_hashes

DEFAULT_CAPACITY = 1 << 16  # block hashes remembered, least recently used dropped first
DEFAULT_MAX_SKEW = 4  # in-flight requests a cache hit may cost over the least busy instance


class PrefixRoutes:
    """For one role: which targets were last sent each block hash, and in-flight counts."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_skew: int = DEFAULT_MAX_SKEW):
        self.capacity = capacity
        self.max_skew = max_skew
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()
        self._in_flight: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, target: str, hashes: Sequence[bytes]) -> None:
        """`target` now holds the blocks named by `hashes` (a prompt's, in order)."""
        with self._lock:
            for h in hashes:
                self._holders.setdefault(h, set()).add(target)
                self._holders.move_to_end(h)
            while len(self._holders) > self.capacity:
                self._holders.popitem(last=False)

    def order(self, targets: Sequence[str], hashes: Sequence[bytes]) -> list[str]:
        """`targets` (in the caller's turn order) best first: among those within `max_skew`
        in-flight requests of the least busy, the longest cached prefix, then the fewest
        in flight, then the caller's order; the busier ones after, in the caller's order."""
        with self._lock:
            load = {t: self._in_flight.get(t, 0) for t in targets}
            matched = {t: self._matched(t, hashes) for t in targets}
        if not targets:
            return []
        low = min(load.values())
        eligible = [t for t in targets if load[t] <= low + self.max_skew]
        best = sorted(eligible, key=lambda t: (-matched[t], load[t]))  # stable: turn order
        return best + [t for t in targets if t not in eligible]

    def started(self, target: str) -> None:
        with self._lock:
            self._in_flight[target] = self._in_flight.get(target, 0) + 1

    def finished(self, target: str) -> None:
        with self._lock:
            self._in_flight[target] -= 1

    def _matched(self, target: str, hashes: Sequence[bytes]) -> int:
        count = 0
        for h in hashes:
            if target not in self._holders.get(h, ()):
                break
            count += 1
        return count


def learn_block_size(prompt: Sequence[int], hashes: Sequence[bytes], num_blocks: int) -> int:
    """The block size a ticket's `hashes` of `prompt` were computed with (the ticket holds
    `num_blocks` blocks), or 0 when they do not say: the one size whose block count and first
    hash both match."""
    n, full = len(prompt), len(hashes)
    if not full:
        return 0
    for size in range(n // (full + 1) + 1, n // full + 1):
        if -(-n // size) == num_blocks and block_hashes(prompt[:size], size)[0] == hashes[0]:
            return size
    return 0
