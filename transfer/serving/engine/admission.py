"""Admission into an instance's pools: wait in a bounded queue for room, or say why not.

A request that can never fit (more blocks than the instance has) is bad input, named with
the limit. One that does not fit now waits for a free, up to `wait_s`, behind at most
`max_queue` others; beyond that it is refused as overload (RESOURCE_EXHAUSTED), which the
router may retry elsewhere.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence

from transfer.cache.pools import CachePools, RequestCache
from transfer.errors import CapacityError, DeadlineExceeded, InvalidInput

RECHECK_S = 0.5  # a free that did not notify is still seen this soon


class Admission:
    """The waiting queue of one instance's pools; call `freed()` after every free."""

    def __init__(self, pools: CachePools, max_queue: int, wait_s: float = 60.0) -> None:
        if max_queue < 0:
            raise InvalidInput(f"max_queue: must be >= 0, got {max_queue}")
        self.pools = pools
        self.max_queue = max_queue
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._waiting = 0

    @property
    def waiting(self) -> int:
        with self._cond:
            return self._waiting

    def allocate(
        self,
        request_id: Hashable,
        num_tokens: int,
        wait_s: float | None = None,
        prefix_blocks: Sequence[int] = (),
    ) -> RequestCache:
        """Blocks for `num_tokens` and a slot, once there is room (waiting at most `wait_s`,
        default the queue's); `prefix_blocks` (a prefix-cache hit) cover the first tokens."""
        wait_s = self.wait_s if wait_s is None else wait_s
        need, total = self.pools.blocks_for(num_tokens), self.pools.blocks.num_total
        if need > total:
            raise InvalidInput(
                f"num_tokens: {num_tokens} tokens need {need} KV blocks of "
                f"{self.pools.block_size}; this instance has {total} in all (--gpu-mem)"
            )
        with self._cond:
            try:
                return self.pools.allocate(request_id, num_tokens, prefix_blocks)
            except CapacityError:
                if self._waiting >= self.max_queue:
                    raise CapacityError(
                        f"request {request_id!r}: no room, and {self._waiting} requests "
                        f"already wait (--max-queue {self.max_queue})"
                    ) from None
            self._waiting += 1
            try:
                deadline = time.monotonic() + wait_s
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise DeadlineExceeded(
                            f"request {request_id!r}: no room within {wait_s:g}s"
                        )
                    self._cond.wait(min(left, RECHECK_S))
                    try:
                        return self.pools.allocate(request_id, num_tokens, prefix_blocks)
                    except CapacityError:
                        continue
            finally:
                self._waiting -= 1

    def freed(self) -> None:
        with self._cond:
            self._cond.notify_all()
