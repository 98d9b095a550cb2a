"""KV block pool, state slot pool, and the per-request allocator over both.

Every call validates first and changes nothing when it fails: a request that cannot be
served leaves the pools exactly as they were. All pools are thread-safe (the control
plane frees from its lease reaper thread). KV blocks are handed out in as few runs of
consecutive ids as the free set allows (`policy="contiguous"`, `extents.FreeExtents`), or
lowest-first (`policy="lowest"`, the old allocator, kept for the benchmark); state slot
groups go lowest-first. A fresh pool gives a request contiguous blocks either way.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from transfer.cache.extents import FreeExtents, count_runs
from transfer.cache.lowest_free import FreeIds, LowestFree
from transfer.errors import CapacityError, InvalidInput, NotFound
from transfer.memplan import MemoryPlan


class CacheFullError(CapacityError):
    """The pool has too few free blocks or slots; nothing was allocated."""


class BlockPolicy(StrEnum):
    """Which free ids a pool hands out: CONTIGUOUS, the fewest free runs; LOWEST, the
    lowest ids first (the old allocator, kept for the benchmark)."""

    CONTIGUOUS = "contiguous"
    LOWEST = "lowest"


BLOCK_POLICIES = tuple(BlockPolicy)


class _IdPool:
    """Ids 0..n-1 with refcounts; `free` (a free list) decides which free ids to hand out."""

    def __init__(self, size: int, what: str, policy: BlockPolicy = BlockPolicy.LOWEST) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidInput(f"num_{what}s must be an integer >= 0, got {size!r}")
        if policy not in BLOCK_POLICIES:
            raise InvalidInput(f"policy must be one of {', '.join(BLOCK_POLICIES)}, got {policy!r}")
        self.size = size
        self.what = what
        self.free: FreeIds = (
            FreeExtents(size) if policy == BlockPolicy.CONTIGUOUS else LowestFree(size)
        )
        self.refs: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return self.free.num_free

    def take(self, n: int) -> list[int]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidInput(f"number of {self.what}s must be an integer >= 0, got {n!r}")
        if n > self.num_free:
            raise CacheFullError(
                f"cannot allocate {n} {self.what}s: {self.num_free} of {self.size} free"
            )
        ids = self.free.take(n)
        for i in ids:
            self.refs[i] = 1
        return ids

    def check_held(self, ids: Sequence[int], field: str) -> list[int]:
        ids = list(ids)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.size:
                raise InvalidInput(f"{field}: {self.what} id {i!r} out of range [0, {self.size})")
            if i not in self.refs:
                raise InvalidInput(f"{field}: {self.what} {i} is not allocated")
        if len(set(ids)) != len(ids):
            raise InvalidInput(f"{field}: duplicate {self.what} ids")
        return ids

    def release(self, ids: Iterable[int]) -> list[int]:
        """Decref each (already checked); returns the ids that became free."""
        freed = []
        for i in ids:
            self.refs[i] -= 1
            if self.refs[i] == 0:
                del self.refs[i]
                freed.append(i)
        self.free.put(freed)
        return freed


class BlockPool:
    """`num_blocks` KV blocks with refcounts (prefix sharing) and per-request block tables.

    `policy="contiguous"` (default) serves each allocation from the fewest free runs: the
    best-fitting run when one holds it, else the largest runs first (`extents.FreeExtents`;
    O(log n) per run touched). The packer posts one descriptor per run of blocks
    consecutive on both sides, so fewer runs mean fewer descriptors. `policy="lowest"` is
    the old lowest-free-first allocator (the benchmark compares the two).

    Prefix-cache seam: only blocks at refcount 0 are in the free extents. A prefix cache
    would keep its evictable blocks (refcount 0 but still indexed) out of them, in its own
    LRU beside the extents, and hand a block to the extents (`free`) only when it evicts
    it; reusing a cached block is `incref`. No block is ever in both orders, so neither
    can go stale, and evicting a block coalesces it with its free neighbours.
    """

    def __init__(self, num_blocks: int, policy: BlockPolicy = BlockPolicy.CONTIGUOUS) -> None:
        self._ids = _IdPool(num_blocks, "block", policy)
        self.policy = policy
        self._tables: dict[Hashable, list[int]] = {}
        self._lock = threading.Lock()

    @property
    def num_total(self) -> int:
        return self._ids.size

    @property
    def num_free(self) -> int:
        with self._lock:
            return self._ids.num_free

    def can_allocate(self, n: int) -> bool:
        with self._lock:
            return 0 <= n <= self._ids.num_free

    def allocate(self, n: int, request_id: Hashable | None = None) -> list[int]:
        """`n` blocks at refcount 1, appended to `request_id`'s table when given.
        Raises CacheFullError (nothing allocated) when fewer than `n` are free."""
        with self._lock:
            ids = self._ids.take(n)
            if request_id is not None and ids:
                self._tables.setdefault(request_id, []).extend(ids)
            return ids

    def incref(self, ids: Sequence[int], request_id: Hashable | None = None) -> None:
        """Share allocated blocks (e.g. a cached prefix), optionally into a request's table."""
        with self._lock:
            ids = self._ids.check_held(ids, "incref")
            for i in ids:
                self._ids.refs[i] += 1
            if request_id is not None:
                self._tables.setdefault(request_id, []).extend(ids)

    def free(self, ids: Sequence[int]) -> list[int]:
        """Decref; returns the blocks that became free. Validates all ids first."""
        with self._lock:
            return self._ids.release(self._ids.check_held(ids, "free"))

    def refcount(self, block: int) -> int:
        with self._lock:
            return self._ids.refs.get(block, 0)

    def block_table(self, request_id: Hashable) -> tuple[int, ...]:
        with self._lock:
            if request_id not in self._tables:
                raise NotFound(f"request_id {request_id!r} has no block table")
            return tuple(self._tables[request_id])

    def runs(self, request_id: Hashable) -> int:
        """Runs of consecutive ids in the request's block table (its fragmentation)."""
        return count_runs(self.block_table(request_id))

    def free_request(self, request_id: Hashable) -> list[int]:
        """Decref the request's whole table and forget it."""
        with self._lock:
            if request_id not in self._tables:
                raise NotFound(f"request_id {request_id!r} has no block table")
            return self._ids.release(self._tables.pop(request_id))


class SlotPool:
    """State slots, handed out in groups of `1 + spec_slots_per_request` adjacent slots (the
    request's slot, then one per speculative token), so a request's state is one run."""

    def __init__(self, num_slots: int, spec_slots_per_request: int = 0) -> None:
        for field, value in (
            ("num_slots", num_slots),
            ("spec_slots_per_request", spec_slots_per_request),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidInput(f"{field} must be an integer >= 0, got {value!r}")
        self.group = 1 + spec_slots_per_request
        if num_slots % self.group:
            raise InvalidInput(
                f"num_slots={num_slots} is not a multiple of 1 + spec_slots_per_request={self.group}"
            )
        self.num_total = num_slots
        self._groups = _IdPool(num_slots // self.group, "slot group")
        self._owners: dict[Hashable, list[int]] = {}
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        with self._lock:
            return self._groups.num_free * self.group

    def can_allocate(self, requests: int = 1) -> bool:
        with self._lock:
            return 0 <= requests <= self._groups.num_free

    def allocate(self, request_id: Hashable | None = None) -> list[int]:
        """The slots of one request: `[slot, spec slot 1, ...]`, adjacent ids."""
        with self._lock:
            if request_id is not None and request_id in self._owners:
                raise InvalidInput(f"request_id {request_id!r} already holds slots")
            try:
                (group,) = self._groups.take(1)
            except CacheFullError:
                raise CacheFullError(
                    f"cannot allocate a state slot: 0 of {self.num_total} free"
                ) from None
            slots = list(range(group * self.group, (group + 1) * self.group))
            if request_id is not None:
                self._owners[request_id] = slots
            return slots

    def free(self, slots: Sequence[int]) -> None:
        """Free one request's slots (exactly the list `allocate` returned)."""
        with self._lock:
            self._groups.release([self._group_of(slots)])

    def _group_of(self, slots: Sequence[int]) -> int:
        slots = list(slots)
        if (
            not slots
            or slots[0] % self.group
            or slots != list(range(slots[0], slots[0] + self.group))
        ):
            raise InvalidInput(f"slots: {slots} is not one request's {self.group} adjacent slots")
        self._groups.check_held([slots[0] // self.group], "slots")
        return slots[0] // self.group

    def slots(self, request_id: Hashable) -> tuple[int, ...]:
        with self._lock:
            if request_id not in self._owners:
                raise NotFound(f"request_id {request_id!r} holds no slots")
            return tuple(self._owners[request_id])

    def free_request(self, request_id: Hashable) -> None:
        with self._lock:
            if request_id not in self._owners:
                raise NotFound(f"request_id {request_id!r} holds no slots")
            self._groups.release([self._group_of(self._owners.pop(request_id))])


@dataclass(frozen=True)
class RequestCache:
    """What one request holds on one instance (every TP rank uses the same ids)."""

    request_id: Hashable
    num_tokens: int
    block_ids: tuple[int, ...]
    slot_ids: tuple[int, ...]


class CachePools:
    """Blocks and slots of one instance; allocates and frees a request's cache atomically."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        num_slots: int,
        spec_slots_per_request: int = 0,
        uses_blocks: bool = True,
        uses_slots: bool = True,
        block_policy: BlockPolicy = BlockPolicy.CONTIGUOUS,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise InvalidInput(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks, block_policy)
        self.slots = SlotPool(num_slots, spec_slots_per_request)
        self.uses_blocks = uses_blocks
        self.uses_slots = uses_slots
        # evictor(n) frees up to n cached blocks nobody references (a prefix cache's)
        self.evictor: Callable[[int], int] | None = None
        self._requests: dict[Hashable, RequestCache] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_plan(
        cls,
        plan: MemoryPlan,
        spec_slots_per_request: int = 0,
        block_policy: BlockPolicy = BlockPolicy.CONTIGUOUS,
    ) -> CachePools:
        """Pools sized by the memory plan (`num_state_slots` counts the speculative slots;
        the checkpoint slots are the prefix cache's, not the pool's)."""
        return cls(
            plan.block_size,
            plan.num_kv_blocks,
            plan.num_request_slots,
            spec_slots_per_request,
            uses_blocks=plan.kv_pages_per_block > 0,
            uses_slots=plan.state_pages_per_slot > 0,
            block_policy=block_policy,
        )

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size) if self.uses_blocks else 0

    def allocate(
        self, request_id: Hashable, num_tokens: int, prefix_blocks: Sequence[int] = ()
    ) -> RequestCache:
        """Blocks for `num_tokens` plus the request's slots, or CacheFullError and no change.
        `prefix_blocks` (a prefix-cache hit, already referenced in the request's block
        table) cover the first tokens; only the rest are allocated. With an `evictor`, cached
        blocks nobody references are evicted to make room."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise InvalidInput(f"num_tokens must be an integer >= 1, got {num_tokens!r}")
        with self._lock:
            if request_id in self._requests:
                raise InvalidInput(f"request_id {request_id!r} already allocated")
            need = self.blocks_for(num_tokens) - len(prefix_blocks)
            if need < 0:
                raise InvalidInput(f"prefix_blocks: {len(prefix_blocks)} cover more than "
                                   f"{num_tokens} tokens")  # fmt: skip
            short = need - self.blocks.num_free
            if short > 0 and self.evictor is not None:
                self.evictor(short)
            if not self.blocks.can_allocate(need):
                raise CacheFullError(
                    f"request {request_id!r}: {num_tokens} tokens need {need} blocks, "
                    f"{self.blocks.num_free} of {self.blocks.num_total} free"
                )
            if self.uses_slots and not self.slots.can_allocate():
                raise CacheFullError(f"request {request_id!r}: no free state slot")
            blocks = self.blocks.allocate(need, request_id)
            slots = self.slots.allocate(request_id) if self.uses_slots else []
            cache = RequestCache(
                request_id, num_tokens, tuple(prefix_blocks) + tuple(blocks), tuple(slots)
            )
            self._requests[request_id] = cache
            return cache

    def free(self, request_id: Hashable) -> RequestCache:
        with self._lock:
            cache = self._get(request_id)
            if cache.block_ids:
                self.blocks.free_request(request_id)
            if cache.slot_ids:
                self.slots.free_request(request_id)
            del self._requests[request_id]
            return cache

    def get(self, request_id: Hashable) -> RequestCache:
        with self._lock:
            return self._get(request_id)

    def _get(self, request_id: Hashable) -> RequestCache:
        if request_id not in self._requests:
            raise NotFound(f"request_id {request_id!r} is not allocated")
        return self._requests[request_id]

    @property
    def num_requests(self) -> int:
        with self._lock:
            return len(self._requests)
