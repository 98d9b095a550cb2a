"""Prefill-side prefix cache for hybrid models: shared KV blocks plus recurrent-state checkpoints.

A full KV block is keyed by the chained hash of its tokens and shared by refcount; the cache
holds its own reference so a block outlives its requests until evicted. Attention can resume
at any cached block boundary, but the recurrent state cannot be recomputed from KV blocks, so
a hit must also end where a state checkpoint (a reserved state slot) was saved.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from transfer.cache.block_hashes import check_int
from transfer.cache.pools import BlockPool
from transfer.errors import InvalidInput, NotFound

_COUNTS = (
    "hits",
    "misses",
    "hit_tokens",
    "checkpoint_saves",
    "block_evictions",
    "checkpoint_evictions",
)


def _check_hash(field: str, value: object) -> None:
    if not isinstance(value, bytes):
        raise InvalidInput(f"{field}: block hash must be bytes, got {type(value).__name__}")


@dataclass(frozen=True)
class PrefixHit:
    """A matched prefix of `num_tokens`. The request holds a reference on each of `block_ids`
    (the hit's whole blocks); the checkpoint slot is pinned. `copy_from` is the block that
    holds the hit's last `num_tokens % block_size` rows (a partial block, copied on write
    into the request's own next block), held by an anonymous reference until
    `release_copy_source`; None when the hit ends on a block boundary."""

    block_ids: tuple[int, ...]
    checkpoint_slot: int | None
    num_tokens: int
    copy_from: int | None = None


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
    """Hash-indexed prompt units over a `BlockPool`, and state checkpoints in reserved slots.

    The match unit (`unit` tokens, the block size unless given) is what is hashed and matched:
    unit i's hash covers units 0..i, and it maps to the blocks holding its rows. A unit smaller
    than the block lets a hit end inside a block; that block is then copied, not shared.
    Each checkpoint slot is exactly one of free, reserved (a save in flight) or committed
    (matchable); a committed slot is pinned while a hit's state is being copied out of it.
    """

    def __init__(
        self,
        blocks: BlockPool,
        block_size: int,
        checkpoint_slots: Sequence[int],
        unit: int | None = None,
    ) -> None:
        if not isinstance(blocks, BlockPool):
            raise InvalidInput(f"blocks must be a BlockPool, got {type(blocks).__name__}")
        self.blocks = blocks
        self.block_size = check_int("block_size", block_size, 1)
        self.unit = block_size if unit is None else check_int("unit", unit, 1)
        slots = [check_int("checkpoint_slots", s, 0) for s in checkpoint_slots]
        if len(set(slots)) != len(slots):
            raise InvalidInput(f"checkpoint_slots: duplicate slot ids in {slots}")
        self._slots = frozenset(slots)
        self._free_slots = sorted(slots, reverse=True)  # pop() hands out the lowest
        self._reserved: dict[int, bytes] = {}  # slot -> hash being saved
        self._committed: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, LRU first
        self._slot_hash: dict[int, bytes] = {}  # committed slot -> hash
        self._pins: dict[int, int] = {}
        self._units: dict[bytes, tuple[int, ...]] = {}  # unit hash -> blocks holding its rows
        self._lru: OrderedDict[int, list[bytes]] = OrderedDict()  # block -> its units, LRU first
        self._counts = dict.fromkeys(_COUNTS, 0)
        self._lock = threading.Lock()

    def _blocks_of(self, index: int) -> range:
        """Block indices (in a block table) that hold unit `index`'s rows."""
        first = index * self.unit // self.block_size
        return range(first, ((index + 1) * self.unit - 1) // self.block_size + 1)

    def _table(self, chain: Sequence[bytes], num_tokens: int) -> list[int]:
        """The block table of a hit of the first `len(chain)` units: block j comes from the
        deepest hit unit touching it, whose registering prompt filled j up to that unit."""
        table = []
        for j in range(-(-num_tokens // self.block_size)):
            deepest = min(len(chain) - 1, ((j + 1) * self.block_size - 1) // self.unit)
            table.append(self._units[chain[deepest]][j - self._blocks_of(deepest).start])
        return table

    def match(
        self,
        hashes: Sequence[bytes],
        max_tokens: int,
        request_id: Hashable,
        needs_checkpoint: bool = True,
    ) -> PrefixHit:
        """Longest cached prefix of `hashes` (one per unit) that ends at a committed checkpoint
        and spans at most `max_tokens` tokens. Its whole blocks go into `request_id`'s block
        table (which must still be empty) with a reference each, and its checkpoint slot is
        pinned until `unpin`. With `needs_checkpoint=False` (a decode instance, to which the
        state crosses whole) the hit is the longest cached run of whole blocks, with no
        checkpoint and no partial block."""
        check_int("max_tokens", max_tokens, 0)
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
            for h in hashes[: max_tokens // self.unit]:
                if h not in self._units:
                    break
                if h in seen:
                    raise InvalidInput("hashes: duplicate block hash")
                seen[h] = None
                whole = len(seen) * self.unit % self.block_size == 0
                if h in self._committed if needs_checkpoint else whole:
                    hit = len(seen)
            if not hit:
                self._counts["misses"] += 1
                return PrefixHit((), None, 0)
            chain = list(seen)[:hit]
            num_tokens = hit * self.unit
            table = self._table(chain, num_tokens)
            whole = num_tokens // self.block_size
            ids, copy_from = tuple(table[:whole]), None
            self.blocks.incref(ids, request_id)
            if whole < len(table):
                copy_from = table[whole]
                self.blocks.incref([copy_from])
            self._touch(table)
            slot = self._committed.get(chain[-1]) if needs_checkpoint else None
            if slot is not None:
                self._pins[slot] = self._pins.get(slot, 0) + 1
                self._committed.move_to_end(chain[-1])
            self._counts["hits"] += 1
            self._counts["hit_tokens"] += num_tokens
            return PrefixHit(ids, slot, num_tokens, copy_from)

    def release_copy_source(self, block: int) -> None:
        """The hit's partial block was copied (or the request failed): drop its reference."""
        self.blocks.free([block])

    def unpin(self, checkpoint_slot: int) -> None:
        """The hit's state was copied out of the slot; it may be evicted again."""
        with self._lock:
            self._check_slot("checkpoint_slot", checkpoint_slot)
            if not self._pins.get(checkpoint_slot):
                raise InvalidInput(f"checkpoint_slot {checkpoint_slot} is not pinned")
            self._pins[checkpoint_slot] -= 1
            if not self._pins[checkpoint_slot]:
                del self._pins[checkpoint_slot]
                if self._slot_hash[checkpoint_slot] not in self._units:
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
        """Register a prompt's full units after the first `held` units (those came from the
        cache): `hashes` [one per full unit], `block_ids` the request's block table."""
        pairs = []
        for i in range(held, len(hashes)):
            span = self._blocks_of(i)
            if span.stop > len(block_ids):
                raise InvalidInput(f"block_ids: {len(block_ids)} blocks do not hold unit {i}")
            pairs.append((hashes[i], tuple(block_ids[span.start : span.stop])))
        return self.insert(pairs)

    def insert(self, hashed_units: Sequence[tuple[bytes, int | Sequence[int]]]) -> int:
        """Register filled units `(hash, block id or the blocks holding its rows)`, in chain
        order, whose blocks a request holds.

        The cache takes its own reference on each block it did not hold yet. A hash already
        cached is skipped (the caller's blocks stay private). Returns how many units were
        registered."""
        pairs = []
        for h, blocks in hashed_units:
            _check_hash("hashed_blocks", h)
            blocks = (blocks,) if isinstance(blocks, (int, np.integer)) else tuple(blocks)
            for b in blocks:
                check_int("hashed_blocks: block id", b, 0)
            pairs.append((h, blocks))
        with self._lock:
            new: dict[bytes, tuple[int, ...]] = {}  # validated before anything changes
            owner: dict[int, bytes] = {}  # a block holds one unit when units are whole blocks
            for h, blocks in pairs:
                for b in blocks if self.unit % self.block_size == 0 else ():
                    known = self._lru[b][0] if self._lru.get(b) else owner.get(b, h)
                    if known != h:
                        raise InvalidInput(f"hashed_blocks: block {b} has another hash")
                    owner[b] = h
                if h in self._units or h in new:
                    continue
                for b in blocks:
                    if self.blocks.refcount(b) < 1:
                        raise InvalidInput(f"hashed_blocks: block {b} is not allocated")
                new[h] = blocks
            fresh = list(dict.fromkeys(b for bs in new.values() for b in bs if b not in self._lru))
            self.blocks.incref(fresh)
            for b in fresh:
                self._lru[b] = []
            for h, blocks in new.items():
                self._units[h] = blocks
                for b in blocks:
                    self._lru[b].append(h)
            self._touch([b for h, _ in pairs if h in self._units for b in self._units[h]])
            return len(new)

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` cached blocks only the cache references, least recently used
        first, with every unit whose rows they hold and the unpinned checkpoints tied to those.
        Returns how many blocks were freed."""
        check_int("num_blocks", num_blocks, 0)
        with self._lock:
            freed = 0
            while freed < num_blocks:
                victim = next((b for b in self._lru if self.blocks.refcount(b) == 1), None)
                if victim is None:
                    break
                freed += self._drop_block(victim)
            self._counts["block_evictions"] += freed
            return freed

    def _drop_block(self, block: int) -> int:
        """Forget `block` and its units; free the blocks left holding no unit. How many went."""
        dropped = 0
        orphans = [block]
        while orphans:
            b = orphans.pop()
            if b not in self._lru:
                continue
            for h in self._lru.pop(b):
                for other in self._units.pop(h, ()):
                    if other in self._lru and other != b:
                        self._lru[other].remove(h)
                        if not self._lru[other]:
                            orphans.append(other)
                slot = self._committed.get(h)
                if slot is not None and slot not in self._pins:
                    self._drop_checkpoint(slot)
            self.blocks.free([b])
            dropped += 1
        return dropped

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
                cached_blocks=len(self._lru),
                evictable_blocks=self._evictable(),
                checkpoints=len(self._committed),
            )

    def checkpoint_of(self, block_hash: bytes) -> int | None:
        """The committed checkpoint slot tied to `block_hash`, if any."""
        with self._lock:
            return self._committed.get(block_hash)

    def _evictable(self) -> int:
        return sum(self.blocks.refcount(b) == 1 for b in self._lru)

    def _touch(self, table: Sequence[int]) -> None:
        # Most recent last, parents after children: eviction then trims a chain from its tail.
        for b in reversed(table):
            if b in self._lru:
                self._lru.move_to_end(b)

    def _drop_checkpoint(self, slot: int) -> None:
        del self._committed[self._slot_hash.pop(slot)]
        self._free_slots.append(slot)
        self._counts["checkpoint_evictions"] += 1

    def _check_slot(self, field: str, slot: object) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or slot not in self._slots:
            raise InvalidInput(f"{field} {slot!r} is not a checkpoint slot")
