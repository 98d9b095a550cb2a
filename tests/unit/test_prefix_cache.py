"""Prefix cache: chained block hashes, checkpoint-gated hits, LRU eviction, pool accounting."""

from __future__ import annotations

import hashlib
import math
import threading
from collections import Counter, OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from transfer.cache.block_hashes import block_hashes
from transfer.cache.pools import BlockPool, CacheFullError
from transfer.cache.prefix_cache import PrefixCache, PrefixHit
from transfer.errors import InvalidInput, NotFound

BS = 4


def make(num_blocks: int = 16, slots: tuple[int, ...] = (100, 101)):
    pool = BlockPool(num_blocks)
    return pool, PrefixCache(pool, BS, slots)


def prefill(pool, cache, rid, tokens, checkpoints=(), free=True):
    """A request prefills `tokens` from scratch: its full blocks are inserted and a checkpoint
    saved at each block index in `checkpoints`. Returns (hashes, the request's block ids)."""
    hashes = block_hashes(tokens, BS)
    ids = pool.allocate(math.ceil(len(tokens) / BS), request_id=rid)
    cache.insert(list(zip(hashes, ids[: len(hashes)], strict=True)))
    for i in checkpoints:
        slot = cache.reserve_checkpoint(hashes[i])
        assert slot is not None
        cache.commit_checkpoint(hashes[i], slot)
    if free:
        pool.free_request(rid)
    return hashes, ids


def held(pool) -> int:
    return sum(pool.refcount(b) > 0 for b in range(pool.num_total))


# -- block_hashes ---------------------------------------------------------------------------


def test_block_hashes_follow_the_chained_formula():
    tokens = [7, 0, 2**40, 3, 9, 9, 9, 9, 1]
    h0 = hashlib.blake2b(b"s" + np.array(tokens[:4], "<i8").tobytes(), digest_size=16).digest()
    h1 = hashlib.blake2b(h0 + np.array(tokens[4:8], "<i8").tobytes(), digest_size=16).digest()
    assert block_hashes(tokens, BS, salt=b"s") == (h0, h1)
    assert block_hashes(np.array(tokens, dtype=np.int64), BS, salt=b"s") == (h0, h1)
    small = [3, 1, 4, 1, 5]
    assert block_hashes(np.array(small, np.int32), BS) == block_hashes(small, BS)


def test_block_hashes_are_chained_and_exclude_the_partial_block():
    tokens = list(range(12))
    base = block_hashes(tokens, BS)
    assert len(base) == 3 and len(set(base)) == 3 and all(len(h) == 16 for h in base)
    assert block_hashes(tokens[:11], BS) == base[:2]
    assert block_hashes(tokens[:3], BS) == ()
    first = block_hashes([99, *tokens[1:]], BS)
    assert all(a != b for a, b in zip(first, base, strict=True))
    last = block_hashes([*tokens[:8], 99, *tokens[9:]], BS)
    assert last[:2] == base[:2] and last[2] != base[2]
    assert all(a != b for a, b in zip(block_hashes(tokens, BS, salt=b"lora-1"), base, strict=True))


def test_same_block_at_another_depth_hashes_differently():
    assert len(set(block_hashes([5] * 12, BS))) == 3


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**20), max_size=40), st.integers(1, 6), st.integers(0, 40))
def test_a_prefix_gets_a_prefix_of_the_hashes(tokens, block_size, cut):
    full = block_hashes(tokens, block_size)
    assert len(full) == len(tokens) // block_size
    assert block_hashes(tokens[:cut], block_size) == full[: min(cut, len(tokens)) // block_size]


@pytest.mark.parametrize(
    ("tokens", "block_size", "salt", "field"),
    [
        ([1, 2], 0, b"", "block_size"),
        ([1, 2], True, b"", "block_size"),
        ([1, 2], 2.0, b"", "block_size"),
        ([1, -2], 2, b"", "token_ids"),
        ([1, 2.0], 2, b"", "token_ids"),
        ([True, 2], 2, b"", "token_ids"),
        ([1, "2"], 2, b"", "token_ids"),
        ([2**63], 2, b"", "token_ids"),
        (np.array([1.0, 2.0]), 2, b"", "token_ids"),
        (np.array([[1, 2]]), 2, b"", "token_ids"),
        ([1, 2], 2, "salt", "salt"),
    ],
)
def test_block_hashes_rejects_bad_input(tokens, block_size, salt, field):
    with pytest.raises(InvalidInput, match=field):
        block_hashes(tokens, block_size, salt)


# -- match ----------------------------------------------------------------------------------


def test_empty_cache_misses_and_takes_nothing():
    pool, cache = make()
    assert cache.match(block_hashes(range(12), BS), 12, "r") == PrefixHit((), None, 0)
    with pytest.raises(NotFound):
        pool.block_table("r")
    s = cache.stats()
    assert (s.hits, s.misses, s.hit_tokens, s.cached_blocks) == (0, 1, 0, 0)


def test_a_hit_needs_a_checkpoint_at_its_end():
    pool, cache = make()
    tokens = list(range(12))
    hashes, ids = prefill(pool, cache, "a", tokens)
    assert cache.stats().cached_blocks == 3
    assert cache.match(hashes, 12, "b").num_tokens == 0  # blocks but no checkpoint
    slot = cache.reserve_checkpoint(hashes[1])
    cache.commit_checkpoint(hashes[1], slot)
    hit = cache.match(hashes, 12, "c")
    assert hit == PrefixHit(tuple(ids[:2]), slot, 8)
    assert cache.checkpoint_of(hashes[1]) == slot and cache.checkpoint_of(hashes[2]) is None
    s = cache.stats()
    assert (s.hits, s.misses, s.hit_tokens, s.checkpoint_saves) == (1, 1, 8, 1)


def test_hit_respects_max_tokens():
    pool, cache = make(slots=(0, 1, 2))
    tokens = list(range(12))
    hashes, ids = prefill(pool, cache, "a", tokens, checkpoints=(0, 1, 2))
    assert cache.match(hashes, 11, "b").block_ids == tuple(ids[:2])  # one token recomputed
    assert cache.match(hashes, 12, "c").num_tokens == 12
    assert cache.match(hashes, 3, "d") == PrefixHit((), None, 0)
    with pytest.raises(InvalidInput, match="max_tokens"):
        cache.match(hashes, -1, "e")


def test_hit_blocks_lead_the_request_table_with_a_reference_each():
    pool, cache = make()
    hashes, ids = prefill(pool, cache, "a", list(range(12)), checkpoints=(2,))
    assert [pool.refcount(b) for b in ids] == [1, 1, 1]  # only the cache holds them
    free_before = pool.num_free
    hit = cache.match(hashes, 100, "b")
    own = pool.allocate(2, request_id="b")
    assert pool.block_table("b") == hit.block_ids + tuple(own)
    assert [pool.refcount(b) for b in ids] == [2, 2, 2]
    assert pool.num_free == free_before - 2
    pool.free_request("b")
    assert [pool.refcount(b) for b in ids] == [1, 1, 1] and pool.num_free == free_before


def test_match_refuses_a_request_that_already_holds_blocks():
    pool, cache = make()
    hashes, _ = prefill(pool, cache, "a", list(range(8)), checkpoints=(1,))
    pool.allocate(1, request_id="b")
    with pytest.raises(InvalidInput, match="request_id"):
        cache.match(hashes, 8, "b")
    assert pool.block_table("b") and cache.stats().hits == 0


def test_a_broken_chain_ends_the_hit():
    pool, cache = make()
    hashes, ids = prefill(pool, cache, "a", list(range(12)), checkpoints=(0, 2))
    pool.allocate(1, request_id="keep")
    pool.incref([ids[0], ids[2]], request_id="keep")  # block 1 alone is evictable
    assert cache.evict(5) == 1
    assert cache.match(hashes, 12, "b").block_ids == (ids[0],)


def test_unpin_only_a_pinned_slot():
    pool, cache = make()
    hashes, _ = prefill(pool, cache, "a", list(range(4)), checkpoints=(0,))
    slot = cache.match(hashes, 4, "b").checkpoint_slot
    cache.match(hashes, 4, "c")
    cache.unpin(slot)
    cache.unpin(slot)  # two hits, two pins
    with pytest.raises(InvalidInput, match="not pinned"):
        cache.unpin(slot)
    with pytest.raises(InvalidInput, match="checkpoint_slot"):
        cache.unpin(7)


# -- insert ---------------------------------------------------------------------------------


def test_insert_takes_its_own_reference_and_skips_known_hashes():
    pool, cache = make()
    hashes = block_hashes(list(range(8)), BS)
    a = pool.allocate(2, request_id="a")
    b = pool.allocate(2, request_id="b")
    assert cache.insert(list(zip(hashes, a, strict=True))) == 2
    assert cache.insert(list(zip(hashes, b, strict=True))) == 0  # b's copies stay private
    assert cache.insert(list(zip(hashes, a, strict=True))) == 0
    assert [pool.refcount(x) for x in a + b] == [2, 2, 1, 1]
    pool.free_request("a")
    pool.free_request("b")
    assert pool.num_free == 16 - 2 and cache.evictable_blocks == 2


def test_insert_rejects_bad_blocks_and_changes_nothing():
    pool, cache = make()
    h = block_hashes(list(range(12)), BS)
    ids = pool.allocate(2, request_id="a")
    cache.insert([(h[0], ids[0])])
    for pairs, message in [
        ([(h[1], ids[1]), (h[2], 9)], "block 9 is not allocated"),
        ([(h[1], ids[0])], "another hash"),
        ([(h[1], ids[1]), (h[2], ids[1])], "another hash"),
        ([(h[1], -1)], "block id"),
        ([("x", ids[1])], "hashed_blocks"),
    ]:
        with pytest.raises(InvalidInput, match=message):
            cache.insert(pairs)
        assert cache.stats().cached_blocks == 1 and pool.refcount(ids[1]) == 1


# -- eviction -------------------------------------------------------------------------------


def test_evict_is_lru_with_deeper_blocks_first():
    pool, cache = make()
    ha, a = prefill(pool, cache, "a", [1] * 12, checkpoints=(2,))
    _, b = prefill(pool, cache, "b", [2] * 8)
    assert cache.evict(1) == 1  # a is older: its tail goes first, with its checkpoint
    assert [pool.refcount(x) for x in a] == [1, 1, 0] and cache.checkpoint_of(ha[2]) is None
    assert cache.evict(2) == 2 and [pool.refcount(x) for x in a] == [0, 0, 0]
    assert [pool.refcount(x) for x in b] == [1, 1]
    s = cache.stats()
    assert (s.block_evictions, s.checkpoint_evictions, s.cached_blocks) == (3, 1, 2)
    assert pool.num_free == 16 - 2


def test_a_hit_makes_its_chain_recent():
    pool, cache = make()
    ha, a = prefill(pool, cache, "a", [1] * 8, checkpoints=(1,))
    _, b = prefill(pool, cache, "b", [2] * 8)
    hit = cache.match(ha, 8, "x")
    pool.free_request("x")
    cache.unpin(hit.checkpoint_slot)
    assert cache.evict(2) == 2 and [pool.refcount(x) for x in b] == [0, 0]
    assert [pool.refcount(x) for x in a] == [1, 1]


def test_reinserting_a_cached_chain_makes_it_recent():
    pool, cache = make()
    ha, a = prefill(pool, cache, "a", [1] * 8)
    _, b = prefill(pool, cache, "b", [2] * 8)
    private = pool.allocate(2, request_id="c")  # c prefilled a's prompt again, privately
    assert cache.insert(list(zip(ha, private, strict=True))) == 0
    pool.free_request("c")
    assert cache.evict(2) == 2 and [pool.refcount(x) for x in b] == [0, 0]
    assert [pool.refcount(x) for x in a] == [1, 1]


def test_referenced_blocks_are_never_evicted():
    pool, cache = make()
    _, ids = prefill(pool, cache, "a", list(range(12)), free=False)
    assert cache.evictable_blocks == 0 and cache.evict(10) == 0
    assert [pool.refcount(b) for b in ids] == [2, 2, 2]
    pool.free_request("a")
    assert cache.evictable_blocks == 3 and cache.evict(10) == 3 and pool.num_free == 16


def test_evicted_block_drops_its_checkpoint_and_match_misses_cleanly():
    pool, cache = make(slots=(5,))
    hashes, _ = prefill(pool, cache, "a", list(range(8)), checkpoints=(1,))
    assert cache.evict(1) == 1
    assert cache.checkpoint_of(hashes[1]) is None and cache.stats().checkpoints == 0
    assert cache.match(hashes, 8, "b") == PrefixHit((), None, 0)
    assert cache.reserve_checkpoint(b"x" * 16) == 5  # the slot came back free


def test_pinned_checkpoint_outlives_its_evicted_block_until_unpinned():
    pool, cache = make(slots=(5,))
    hashes, _ = prefill(pool, cache, "a", list(range(8)), checkpoints=(1,))
    hit = cache.match(hashes, 8, "b")
    pool.free_request("b")  # the request finished before its state copy was unpinned
    assert cache.evict(2) == 2
    assert cache.checkpoint_of(hashes[1]) == hit.checkpoint_slot  # pinned: kept
    assert cache.match(hashes, 8, "c").num_tokens == 0  # but its blocks are gone
    assert cache.reserve_checkpoint(b"y" * 16) is None
    cache.unpin(hit.checkpoint_slot)
    assert cache.checkpoint_of(hashes[1]) is None
    assert cache.reserve_checkpoint(b"y" * 16) == 5


def test_reserve_evicts_the_lru_unpinned_checkpoint_never_a_pinned_one():
    pool, cache = make(slots=(0, 1))
    ha, _ = prefill(pool, cache, "a", [1] * 4, checkpoints=(0,))
    hb, _ = prefill(pool, cache, "b", [2] * 4, checkpoints=(0,))
    slot_a, slot_b = cache.checkpoint_of(ha[0]), cache.checkpoint_of(hb[0])
    hit = cache.match(ha, 4, "x")  # a is now the most recent, and pinned
    assert cache.reserve_checkpoint(b"c" * 16) == slot_b
    assert cache.checkpoint_of(hb[0]) is None and cache.checkpoint_of(ha[0]) == slot_a
    assert cache.reserve_checkpoint(b"d" * 16) is None  # a pinned, c reserved
    cache.unpin(hit.checkpoint_slot)
    assert cache.reserve_checkpoint(b"d" * 16) == slot_a
    assert cache.stats().checkpoint_evictions == 2


def test_reserve_lru_follows_use_not_commit_order():
    pool, cache = make(slots=(0, 1))
    ha, _ = prefill(pool, cache, "a", [1] * 4, checkpoints=(0,))
    hb, _ = prefill(pool, cache, "b", [2] * 4, checkpoints=(0,))
    cache.unpin(cache.match(ha, 4, "x").checkpoint_slot)
    assert cache.reserve_checkpoint(b"c" * 16) == 1  # b's slot: b was used less recently
    assert cache.checkpoint_of(hb[0]) is None and cache.checkpoint_of(ha[0]) == 0


def test_reserve_refuses_a_hash_already_saved_or_being_saved():
    _, cache = make(slots=(0, 1))
    h = b"h" * 16
    slot = cache.reserve_checkpoint(h)
    assert cache.reserve_checkpoint(h) is None
    cache.commit_checkpoint(h, slot)
    assert cache.reserve_checkpoint(h) is None
    other = cache.reserve_checkpoint(b"o" * 16)
    cache.cancel_checkpoint(other)
    assert cache.reserve_checkpoint(b"p" * 16) == other


def test_no_checkpoint_slots_never_hit():
    pool = BlockPool(8)
    cache = PrefixCache(pool, BS, ())
    hashes = block_hashes(list(range(8)), BS)
    cache.insert(list(zip(hashes, pool.allocate(2, request_id="a"), strict=True)))
    assert cache.reserve_checkpoint(hashes[1]) is None
    assert cache.match(hashes, 8, "b").num_tokens == 0


def test_checkpoint_calls_validate_their_slot():
    _, cache = make(slots=(0, 1))
    h = b"h" * 16
    slot = cache.reserve_checkpoint(h)
    for call, message in [
        (lambda: cache.commit_checkpoint(h, 9), "slot 9 is not a checkpoint slot"),
        (lambda: cache.commit_checkpoint(h, True), "not a checkpoint slot"),
        (lambda: cache.commit_checkpoint(h, 1 - slot), "not reserved"),
        (lambda: cache.commit_checkpoint(b"g" * 16, slot), "not reserved for this block_hash"),
        (lambda: cache.commit_checkpoint("h", slot), "block_hash"),
        (lambda: cache.cancel_checkpoint(1 - slot), "not reserved"),
        (lambda: cache.reserve_checkpoint(None), "block_hash"),
        (lambda: cache.unpin(slot), "not pinned"),
        (lambda: cache.evict(-1), "num_blocks"),
    ]:
        with pytest.raises(InvalidInput, match=message):
            call()
    cache.commit_checkpoint(h, slot)
    with pytest.raises(InvalidInput, match="not reserved"):
        cache.cancel_checkpoint(slot)
    assert cache.checkpoint_of(h) == slot and cache.stats().checkpoint_saves == 1


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((8, 0, ()), "block_size"),
        ((8, 4, (0, 0)), "checkpoint_slots"),
        ((8, 4, (-1,)), "checkpoint_slots"),
        ((8, 4, ("a",)), "checkpoint_slots"),
    ],
)
def test_constructor_rejects_bad_input(args, field):
    num_blocks, block_size, slots = args
    with pytest.raises(InvalidInput, match=field):
        PrefixCache(BlockPool(num_blocks), block_size, slots)


def test_constructor_needs_a_block_pool():
    with pytest.raises(InvalidInput, match="blocks"):
        PrefixCache(object(), 4, ())


# -- concurrency ----------------------------------------------------------------------------


def test_concurrent_requests_keep_the_pool_consistent():
    pool = BlockPool(64)
    cache = PrefixCache(pool, BS, range(6))
    prompts = [[p] * 4 + list(range(n)) for p in range(3) for n in (4, 9)]
    errors = []

    def worker(w: int) -> None:
        try:
            for i in range(150):
                tokens = prompts[(w + i) % len(prompts)]
                hashes, rid = block_hashes(tokens, BS), (w, i)
                hit = cache.match(hashes, len(tokens) - 1, rid)
                need = math.ceil(len(tokens) / BS) - len(hit.block_ids)
                try:
                    own = pool.allocate(need, request_id=rid)
                except CacheFullError:
                    cache.evict(need)
                    own = []
                table = list(hit.block_ids) + own
                cache.insert(list(zip(hashes, table, strict=False)))  # partial tables too
                slot = cache.reserve_checkpoint(hashes[-1])
                if slot is not None:
                    cache.commit_checkpoint(hashes[-1], slot)
                if hit.checkpoint_slot is not None:
                    cache.unpin(hit.checkpoint_slot)
                if table:
                    pool.free_request(rid)
                cache.evict(i % 3)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = cache.stats()
    assert s.cached_blocks == s.evictable_blocks == held(pool) == 64 - pool.num_free
    assert s.hits > 0 and s.checkpoints <= 6
    assert cache.evict(64) == s.cached_blocks and pool.num_free == 64


# -- model-checked random operation sequences -----------------------------------------------

MACHINE_BS, MACHINE_BLOCKS, MACHINE_SLOTS = 2, 14, (10, 11, 12)
# Prompts that share prefixes, so hits, shared blocks and evictions all happen.
PROMPTS = [[0, 0, 1, 1, 2, 2, 3], [0, 0, 1, 1, 5, 5], [0, 0, 7, 7, 8], [9, 9, 9, 9], [4]]
HASHES = [block_hashes(p, MACHINE_BS) for p in PROMPTS]


class PrefixCacheMachine(RuleBasedStateMachine):
    """Drives the cache with a model: cached hash -> block (LRU), checkpoints (LRU), pins."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(MACHINE_BLOCKS)
        self.cache = PrefixCache(self.pool, MACHINE_BS, MACHINE_SLOTS)
        self.cached: OrderedDict[bytes, int] = OrderedDict()  # least recent first
        self.ckpts: OrderedDict[bytes, int] = OrderedDict()  # least recent first
        self.reserved: dict[int, bytes] = {}
        self.pins: Counter[int] = Counter()
        self.requests: dict[int, tuple[tuple[bytes, ...], list[int]]] = {}
        self.next_id = 0

    def touch(self, chain) -> None:
        for h in reversed(chain):
            self.cached.move_to_end(h)

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), cut=st.integers(0, 2), fill=st.booleans())
    def start_request(self, prompt, cut, fill):
        """Match, make room (evicting) for the rest, allocate it, and maybe insert at once."""
        tokens, hashes = PROMPTS[prompt], HASHES[prompt]
        rid, self.next_id = self.next_id, self.next_id + 1
        max_tokens = max(len(tokens) - cut, 0)
        expect = 0
        for k in range(1, min(len(hashes), max_tokens // MACHINE_BS) + 1):
            if hashes[k - 1] not in self.cached:
                break
            if hashes[k - 1] in self.ckpts:
                expect = k
        hit = self.cache.match(hashes, max_tokens, rid)
        assert len(hit.block_ids) == expect and hit.num_tokens == expect * MACHINE_BS
        if not expect:
            assert hit == PrefixHit((), None, 0)
        else:
            chain = hashes[:expect]
            assert hit.block_ids == tuple(self.cached[h] for h in chain)
            assert hit.checkpoint_slot == self.ckpts[chain[-1]]
            assert self.pool.block_table(rid) == hit.block_ids
            self.pins[hit.checkpoint_slot] += 1
            self.touch(chain)
            self.ckpts.move_to_end(chain[-1])
        need = math.ceil(len(tokens) / MACHINE_BS) - expect
        if need > self.pool.num_free:
            self.evict(need - self.pool.num_free)
        if self.pool.can_allocate(need):
            own = self.pool.allocate(need, request_id=rid)
            self.requests[rid] = (hashes, list(hit.block_ids) + own)
            if fill:
                self.insert_request(rid)
        elif expect:
            self.pool.free_request(rid)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def insert(self, data):
        self.insert_request(data.draw(st.sampled_from(sorted(self.requests))))

    def insert_request(self, rid: int) -> None:
        hashes, table = self.requests[rid]
        pairs = list(zip(hashes, table[: len(hashes)], strict=True))
        new = 0
        for h, b in pairs:
            if h not in self.cached:
                self.cached[h] = b
                new += 1
        assert self.cache.insert(pairs) == new
        self.touch(hashes)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free_request(self, data):
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        del self.requests[rid]
        self.pool.free_request(rid)

    @rule(n=st.integers(0, 5))
    def evict(self, n):
        victims = [h for h, b in self.cached.items() if self.pool.refcount(b) == 1][:n]
        assert self.cache.evict(n) == len(victims)
        for h in victims:
            assert self.pool.refcount(self.cached.pop(h)) == 0
            if h in self.ckpts and not self.pins[self.ckpts[h]]:
                del self.ckpts[h]

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        slot = data.draw(st.sampled_from(sorted(self.pins)))
        self.cache.unpin(slot)
        self.pins[slot] -= 1
        if not self.pins[slot]:
            del self.pins[slot]
            h = next(h for h, s in self.ckpts.items() if s == slot)
            if h not in self.cached:
                del self.ckpts[h]

    @precondition(lambda self: any(hashes for hashes, _ in self.requests.values()))
    @rule(data=st.data(), now=st.booleans())
    def save_request_checkpoint(self, data, now):
        """A live request saves its state at one of its block boundaries (or starts to)."""
        rids = sorted(rid for rid, (hashes, _) in self.requests.items() if hashes)
        hashes, _ = self.requests[data.draw(st.sampled_from(rids))]
        h = data.draw(st.sampled_from(hashes))
        slot = self.reserve_and_check(h)
        if slot is not None and now:
            self.cache.commit_checkpoint(h, slot)
            self.ckpts[self.reserved.pop(slot)] = slot

    def reserve_and_check(self, h: bytes) -> int | None:
        busy = set(self.ckpts.values()) | set(self.reserved)
        free = set(MACHINE_SLOTS) - busy
        victim = next((k for k, s in self.ckpts.items() if s not in self.pins), None)
        slot = self.cache.reserve_checkpoint(h)
        if h in self.ckpts or h in self.reserved.values() or (not free and victim is None):
            assert slot is None
            return None
        if free:
            assert slot in free
        else:
            assert slot == self.ckpts[victim]
            del self.ckpts[victim]
        self.reserved[slot] = h
        return slot

    @precondition(lambda self: self.reserved)
    @rule(data=st.data(), commit=st.booleans())
    def finish_save(self, data, commit):
        slot = data.draw(st.sampled_from(sorted(self.reserved)))
        h = self.reserved.pop(slot)
        if commit:
            self.cache.commit_checkpoint(h, slot)
            self.ckpts[h] = slot
        else:
            self.cache.cancel_checkpoint(slot)

    @invariant()
    def pool_accounts_for_every_block(self):
        expected = Counter(b for _, table in self.requests.values() for b in table)
        expected.update(self.cached.values())
        actual = {b: self.pool.refcount(b) for b in range(MACHINE_BLOCKS)}
        assert actual == {b: expected.get(b, 0) for b in range(MACHINE_BLOCKS)}
        assert self.pool.num_free + len(expected) == MACHINE_BLOCKS

    @invariant()
    def checkpoints_match_the_model(self):
        committed = list(self.ckpts.values())
        assert len(set(committed)) == len(committed)
        assert not set(committed) & set(self.reserved)
        assert set(self.pins) <= set(committed)
        for h, slot in self.ckpts.items():
            assert self.cache.checkpoint_of(h) == slot
        s = self.cache.stats()
        assert s.checkpoints == len(self.ckpts) and s.cached_blocks == len(self.cached)
        assert s.evictable_blocks == sum(self.pool.refcount(b) == 1 for b in self.cached.values())


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=40, deadline=None
)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
