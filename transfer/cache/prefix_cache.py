"""Prefill-side prefix cache for hybrid models: shared KV blocks plus recurrent-state checkpoints.

A full KV block is keyed by the chained hash of its tokens and shared by refcount; the cache
holds its own reference so a block outlives its requests until evicted. Attention can resume
at any cached block boundary, but the recurrent state cannot be recomputed from KV blocks, so
a hit must also end where a state checkpoint (a reserved state slot) was saved.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from transfer.cache.pools import BlockPool
from transfer.errors import InvalidInput, NotFound

_INT64_MAX = np.iinfo(np.int64).max
_COUNTS = (
    "hits",
    "misses",
    "hit_tokens",
    "checkpoint_saves",
    "block_evictions",
    "checkpoint_evictions",
)


def _check_int(field: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInput(f"{field} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_hash(field: str, value: object) -> None:
    if not isinstance(value, bytes):
        raise InvalidInput(f"{field}: block hash must be bytes, got {type(value).__name__}")


def _is_token(t: object) -> bool:
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
        return False
    return 0 <= t <= _INT64_MAX


def _token_array(token_ids: Sequence[int]) -> np.ndarray:
    try:
        arr = np.asarray(token_ids)
    except (TypeError, ValueError):  # ragged
        arr = np.asarray([None])
    ok = arr.ndim == 1 and (
        not arr.size or arr.dtype.kind in "iu" and arr.min() >= 0 and arr.max() <= _INT64_MAX
    )
    if ok and not isinstance(token_ids, np.ndarray):  # numpy reads [True, 2] as integers
        ok = not any(isinstance(t, (bool, np.bool_)) for t in token_ids)
    if not ok:
        bad = next((t for t in token_ids if not _is_token(t)), token_ids)
        raise InvalidInput(f"token_ids: token {bad!r} is not an integer in [0, 2**63)")
    return arr.astype("<i8", copy=False)


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> tuple[bytes, ...]:
    """Chained hash of every full block of `token_ids`: hash i covers blocks 0..i.

    hash_i = blake2b((hash_{i-1} or salt) + block i's tokens as little-endian int64), 16 bytes.
    A trailing partial block has no hash.
    """
    _check_int("block_size", block_size, 1)
    if not isinstance(salt, bytes):
        raise InvalidInput(f"salt must be bytes, got {type(salt).__name__}")
    arr = _token_array(token_ids)
    hashes, prev = [], salt
    for start in range(0, len(arr) - block_size + 1, block_size):
        prev = hashlib.blake2b(prev + arr[start : start + block_size].tobytes(), digest_size=16)
        prev = prev.digest()
        hashes.append(prev)
    return tuple(hashes)


@dataclass(frozen=True)
class PrefixHit:
    """A matched prefix. The request holds a reference on each block; the slot is pinned."""

    block_ids: tuple[int, ...]
    checkpoint_slot: int | None
    num_tokens: int


@dataclass(frozen=True)
class PrefixStats:
    hits: int
    misses: int
    hit_tokens: int
    checkpoint_saves: int
    block_evictions: int
    checkpoint_evictions: int
    cached_blocks: int
    evictable_blocks: int
    checkpoints: int


class PrefixCache:
    """Hash-indexed full blocks over a `BlockPool`, and state checkpoints in reserved slots.

    Each checkpoint slot is exactly one of free, reserved (a save in flight) or committed
    (matchable); a committed slot is pinned while a hit's state is being copied out of it.
    """

    def __init__(self, blocks: BlockPool, block_size: int, checkpoint_slots: Sequence[int]) -> None:
        if not isinstance(blocks, BlockPool):
            raise InvalidInput(f"blocks must be a BlockPool, got {type(blocks).__name__}")
        self.blocks = blocks
        self.block_size = _check_int("block_size", block_size, 1)
        slots = [_check_int("checkpoint_slots", s, 0) for s in checkpoint_slots]
        if len(set(slots)) != len(slots):
            raise InvalidInput(f"checkpoint_slots: duplicate slot ids in {slots}")
        self._slots = frozenset(slots)
        self._free_slots = sorted(slots, reverse=True)  # pop() hands out the lowest
        self._reserved: dict[int, bytes] = {}  # slot -> hash being saved
        self._committed: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, LRU first
        self._slot_hash: dict[int, bytes] = {}  # committed slot -> hash
        self._pins: dict[int, int] = {}
        self._cached: OrderedDict[bytes, int] = OrderedDict()  # hash -> block, LRU first
        self._hash_of: dict[int, bytes] = {}
        self._counts = dict.fromkeys(_COUNTS, 0)
        self._lock = threading.Lock()

    def match(
        self,
        hashes: Sequence[bytes],
        max_tokens: int,
        request_id: Hashable,
        needs_checkpoint: bool = True,
    ) -> PrefixHit:
        """Longest cached prefix of `hashes` that ends at a committed checkpoint and spans at most
        `max_tokens` tokens. Its blocks go into `request_id`'s block table (which must still be
        empty) with a reference each, and its checkpoint slot is pinned until `unpin`. With
        `needs_checkpoint=False` (a decode instance, to which the state crosses whole) the
        hit is the longest cached run of blocks, with no checkpoint."""
        _check_int("max_tokens", max_tokens, 0)
        if request_id is None:
            raise InvalidInput("request_id must not be None")
        with self._lock:
            try:
                if self.blocks.block_table(request_id):
                    raise InvalidInput(f"request_id {request_id!r} already holds blocks")
            except NotFound:
                pass
            seen: dict[bytes, None] = {}  # insertion-ordered: the cached run of `hashes`
            hit = 0
            for h in hashes[: max_tokens // self.block_size]:
                if h not in self._cached:
                    break
                if h in seen:
                    raise InvalidInput("hashes: duplicate block hash")
                seen[h] = None
                if h in self._committed or not needs_checkpoint:
                    hit = len(seen)
            if not hit:
                self._counts["misses"] += 1
                return PrefixHit((), None, 0)
            chain = list(seen)[:hit]
            ids = tuple(self._cached[h] for h in chain)
            self.blocks.incref(ids, request_id)
            self._touch(chain)
            slot = self._committed.get(chain[-1]) if needs_checkpoint else None
            if slot is not None:
                self._pins[slot] = self._pins.get(slot, 0) + 1
                self._committed.move_to_end(chain[-1])
            num_tokens = hit * self.block_size
            self._counts["hits"] += 1
            self._counts["hit_tokens"] += num_tokens
            return PrefixHit(ids, slot, num_tokens)

    def unpin(self, checkpoint_slot: int) -> None:
        """The hit's state was copied out of the slot; it may be evicted again."""
        with self._lock:
            self._check_slot("checkpoint_slot", checkpoint_slot)
            if not self._pins.get(checkpoint_slot):
                raise InvalidInput(f"checkpoint_slot {checkpoint_slot} is not pinned")
            self._pins[checkpoint_slot] -= 1
            if not self._pins[checkpoint_slot]:
                del self._pins[checkpoint_slot]
                if self._slot_hash[checkpoint_slot] not in self._cached:
                    self._drop_checkpoint(checkpoint_slot)  # its block went while it was pinned

    def reserve_checkpoint(self, block_hash: bytes) -> int | None:
        """A slot, pinned until commit/cancel, to save the state ending at block `block_hash`.

        None when that hash already has a committed or reserved checkpoint, or every slot is
        pinned or reserved. Takes a free slot, else evicts the least recently used unpinned
        committed checkpoint."""
        _check_hash("block_hash", block_hash)
        with self._lock:
            if block_hash in self._committed or block_hash in self._reserved.values():
                return None
            if not self._free_slots:
                unpinned = (s for s in self._committed.values() if s not in self._pins)
                victim = next(unpinned, None)
                if victim is None:
                    return None
                self._drop_checkpoint(victim)
            slot = self._free_slots.pop()
            self._reserved[slot] = block_hash
            return slot

    def commit_checkpoint(self, block_hash: bytes, slot: int) -> None:
        """The state ending at `block_hash` is in `slot` (reserved for it); it is now matchable."""
        _check_hash("block_hash", block_hash)
        with self._lock:
            self._check_slot("slot", slot)
            if self._reserved.get(slot) != block_hash:
                raise InvalidInput(f"slot {slot} is not reserved for this block_hash")
            del self._reserved[slot]
            self._committed[block_hash] = slot
            self._slot_hash[slot] = block_hash
            self._counts["checkpoint_saves"] += 1

    def cancel_checkpoint(self, slot: int) -> None:
        """The save into the reserved `slot` did not happen; the slot is free again."""
        with self._lock:
            self._check_slot("slot", slot)
            if slot not in self._reserved:
                raise InvalidInput(f"slot {slot} is not reserved")
            del self._reserved[slot]
            self._free_slots.append(slot)

    def insert_prompt(
        self, hashes: Sequence[bytes], block_ids: Sequence[int], held: int = 0
    ) -> int:
        """Register a prompt's full blocks after the first `held` (those came from the cache):
        `hashes` [one per full block], `block_ids` the request's block table."""
        return self.insert(list(zip(hashes[held:], block_ids[held : len(hashes)], strict=True)))

    def insert(self, hashed_blocks: Sequence[tuple[bytes, int]]) -> int:
        """Register filled full blocks `(hash, block id)`, in chain order, that a request holds.

        The cache takes its own reference on each newly registered block. A hash already cached
        is skipped (the caller's block stays private). Returns how many were registered."""
        pairs = list(hashed_blocks)
        for h, _ in pairs:
            _check_hash("hashed_blocks", h)
        with self._lock:
            new: dict[int, bytes] = {}  # block -> hash, validated before anything changes
            new_hashes: set[bytes] = set()
            for h, block in pairs:
                _check_int("hashed_blocks: block id", block, 0)
                if self._hash_of.get(block, new.get(block, h)) != h:
                    raise InvalidInput(f"hashed_blocks: block {block} has another hash")
                if h in self._cached or h in new_hashes:
                    continue
                if self.blocks.refcount(block) < 1:
                    raise InvalidInput(f"hashed_blocks: block {block} is not allocated")
                new[block] = h
                new_hashes.add(h)
            self.blocks.incref(list(new))
            for block, h in new.items():
                self._cached[h] = block
                self._hash_of[block] = h
            self._touch([h for h, _ in pairs if h in self._cached])
            return len(new)

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` cached blocks only the cache references, least recently used
        first, and drop the unpinned checkpoints tied to them. Returns how many were freed."""
        _check_int("num_blocks", num_blocks, 0)
        with self._lock:
            victims = []
            for h in self._cached:
                if len(victims) == num_blocks:
                    break
                if self.blocks.refcount(self._cached[h]) == 1:
                    victims.append(h)
            self.blocks.free([self._cached[h] for h in victims])
            for h in victims:
                del self._hash_of[self._cached.pop(h)]
                slot = self._committed.get(h)
                if slot is not None and slot not in self._pins:
                    self._drop_checkpoint(slot)
            self._counts["block_evictions"] += len(victims)
            return len(victims)

    @property
    def evictable_blocks(self) -> int:
        """Cached blocks that only the cache references."""
        with self._lock:
            return self._evictable()

    def counts(self) -> dict[str, int]:
        """The event counters of `stats` alone: O(1), for metrics after every request."""
        with self._lock:
            return dict(self._counts)

    def stats(self) -> PrefixStats:
        with self._lock:
            return PrefixStats(
                **self._counts,
                cached_blocks=len(self._cached),
                evictable_blocks=self._evictable(),
                checkpoints=len(self._committed),
            )

    def checkpoint_of(self, block_hash: bytes) -> int | None:
        """The committed checkpoint slot tied to `block_hash`, if any."""
        with self._lock:
            return self._committed.get(block_hash)

    def _evictable(self) -> int:
        return sum(self.blocks.refcount(b) == 1 for b in self._hash_of)

    def _touch(self, chain: Sequence[bytes]) -> None:
        # Most recent last, parents after children: eviction then trims a chain from its tail.
        for h in reversed(chain):
            self._cached.move_to_end(h)

    def _drop_checkpoint(self, slot: int) -> None:
        del self._committed[self._slot_hash.pop(slot)]
        self._free_slots.append(slot)
        self._counts["checkpoint_evictions"] += 1

    def _check_slot(self, field: str, slot: object) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or slot not in self._slots:
            raise InvalidInput(f"{field} {slot!r} is not a checkpoint slot")
