"""The prefix cache's checkpoint policy and its plumbing below the workers: where a prompt
saves its state, the batcher ending chunks there and asking the cache for slots, the pools
allocating behind a hit and evicting for room, the memory plan's checkpoint slots, and the
ticket's cached_tokens on the wire."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.cache.pools import CacheFullError, CachePools
from transfer.cache.prefix_cache import PrefixCache, block_hashes
from transfer.control.convert import ticket_from_pb, ticket_to_pb
from transfer.control.metrics import WorkerMetrics
from transfer.control.types import Ticket
from transfer.errors import InvalidInput
from transfer.memplan import plan_memory
from transfer.presets import get_preset
from transfer.serving.engine.checkpoints import PREFIX_UNIT, checkpoint_positions, checkpoint_stops
from transfer.serving.engine.prefill_batcher import PrefillBatcher
from transfer.serving.ranks.commands import PrefillBatch, TokenPick


@settings(max_examples=200, deadline=None)
@given(
    num_tokens=st.integers(1, 5000),
    cached_units=st.integers(0, 80),
    every=st.integers(0, 4),
)
def test_positions_are_aligned_after_the_hit_and_cover_the_prompt_end(
    num_tokens, cached_units, every
):
    align = PREFIX_UNIT  # whatever the block size
    cached = min(cached_units * align, (num_tokens - 1) // align * align)
    interval = every * align
    got = checkpoint_positions(num_tokens, cached, interval)
    assert got == sorted(set(got))
    assert all(p % align == 0 and cached < p <= num_tokens for p in got)
    last = num_tokens // align * align
    assert (last in got) == (last > cached)  # the prompt end's checkpoint, unless cached
    if interval:
        assert set(range(interval, last + 1, interval)) - set(got) <= set(range(0, cached + 1))
    else:
        assert len(got) <= 1


def test_stops_name_the_unit_each_position_ends():
    ids = list(range(300))
    hashes = block_hashes(ids, PREFIX_UNIT)
    stops = checkpoint_stops(hashes, [64, 256])
    assert stops == {64: hashes[0], 256: hashes[3]}


class RecordingRanks:
    def __init__(self) -> None:
        self.chunks = []

    def call(self, command: PrefillBatch):
        self.chunks.append(command.chunks)
        return [tuple(TokenPick(7, -1.0) for _ in command.chunks)]


def test_batcher_ends_chunks_at_checkpoints_and_saves_them_in_the_caches_slots():
    pools = CachePools(16, 64, 4)
    cache = PrefixCache(pools.blocks, 16, [10, 11])
    ranks = RecordingRanks()
    batcher = PrefillBatcher(ranks, 1000, cache)
    try:
        prompt = tuple(range(200))
        hashes = block_hashes(prompt, PREFIX_UNIT)
        stops = checkpoint_stops(hashes, [64, 128])
        batcher.run("r", prompt, (0,), 0, checkpoints=stops)
        steps = [(c.context_len, len(c.tokens), c.checkpoint_to) for (c,) in ranks.chunks]
        assert steps == [(0, 64, 10), (64, 64, 11), (128, 72, -1)]
        assert cache.checkpoint_of(hashes[0]) == 10 and cache.checkpoint_of(hashes[1]) == 11
        # a hit restores in its first chunk only
        ranks.chunks.clear()
        batcher.run("s", prompt, (1,), 1, cached_tokens=128, restore_from=11)
        assert [(c.context_len, c.restore_from) for (c,) in ranks.chunks] == [(128, 11)]
        # a hit ending inside a block copies that block's rows in its first chunk only
        ranks.chunks.clear()
        stops = checkpoint_stops(hashes, [192])
        batcher.run("t", prompt, (1, 2), 2, cached_tokens=64, restore_from=10, copy_block=5,
                    checkpoints=stops)  # fmt: skip
        got = [(c.context_len, c.restore_from, c.copy_block) for (c,) in ranks.chunks]
        assert got == [(64, 10, 5), (192, -1, -1)]
    finally:
        batcher.close()


def test_batcher_refuses_a_hit_without_a_checkpoint_or_covering_the_prompt():
    batcher = PrefillBatcher(RecordingRanks(), 100)
    try:
        with pytest.raises(InvalidInput, match="cached_tokens"):
            batcher.run("r", (1, 2, 3), (0,), 0, cached_tokens=2)
        with pytest.raises(InvalidInput, match="cached_tokens"):
            batcher.run("r", (1, 2, 3), (0,), 0, cached_tokens=3, restore_from=5)
        with pytest.raises(InvalidInput, match="copy_block"):
            batcher.run("r", (1, 2, 3), (0,), 0, copy_block=4)
    finally:
        batcher.close()


def test_a_failed_step_gives_its_reserved_checkpoint_back():
    class Failing(RecordingRanks):
        def call(self, command):
            raise RuntimeError("rank died")

    pools = CachePools(16, 64, 4)
    cache = PrefixCache(pools.blocks, 16, [9])
    batcher = PrefillBatcher(Failing(), 100, cache)
    try:
        prompt = tuple(range(64))
        stops = checkpoint_stops(block_hashes(prompt, PREFIX_UNIT), [64])
        with pytest.raises(RuntimeError):
            batcher.run("r", prompt, (0,), 0, checkpoints=stops)
        assert cache.reserve_checkpoint(b"x" * 16) == 9  # free again
    finally:
        batcher.close()


def test_pools_allocate_behind_a_hit_and_evict_cached_blocks_for_room():
    pools = CachePools(16, 8, 2)
    cache = PrefixCache(pools.blocks, 16, [])
    pools.evictor = cache.evict
    first = pools.allocate("a", 16 * 8)
    cache.insert(list(zip(block_hashes(range(128), 16), first.block_ids, strict=True)))
    pools.free("a")
    assert pools.blocks.num_free == 0 and cache.evictable_blocks == 8
    second = pools.allocate("b", 16 * 3)  # evicts three cached blocks
    assert len(second.block_ids) == 3 and cache.stats().block_evictions == 3
    pools.blocks.incref(first.block_ids[:2], "c")
    shared = pools.allocate("c", 16 * 4, prefix_blocks=first.block_ids[:2])
    assert shared.block_ids[:2] == first.block_ids[:2] and len(shared.block_ids) == 4
    with pytest.raises(CacheFullError):
        pools.allocate("d", 16 * 8)
    # d took nothing; the one block nobody referenced was evicted trying
    assert pools.num_requests == 2 and pools.blocks.num_free == 1


def test_checkpoint_slots_are_planned_past_the_request_slots():
    geometry = get_preset("tiny-qwen3-next")
    plain = plan_memory(geometry, 1, 16 << 20, 4)
    with_checkpoints = plan_memory(geometry, 1, 16 << 20, 4, checkpoint_slots=3)
    assert with_checkpoints.num_state_slots == plain.num_state_slots + 3
    assert with_checkpoints.num_request_slots == plain.num_state_slots
    assert list(with_checkpoints.checkpoint_slot_ids) == [4, 5, 6]
    assert with_checkpoints.num_kv_blocks < plain.num_kv_blocks
    with pytest.raises(InvalidInput, match="checkpoint_slots"):
        plan_memory(geometry, 1, 16 << 20, 4, checkpoint_slots=-1)


def test_cached_tokens_and_block_hashes_cross_the_wire_and_are_checked():
    hashes = block_hashes(range(40), 16)
    ticket = Ticket("r", "p", (1, 2, 3), 0, 40, 5, 1e9, cached_tokens=32, block_hashes=hashes)
    back = ticket_from_pb(ticket_to_pb(ticket))
    assert (back.cached_tokens, back.block_hashes) == (32, hashes)
    bad = ticket_to_pb(ticket)
    bad.cached_tokens = 40
    with pytest.raises(InvalidInput, match="cached_tokens"):
        ticket_from_pb(bad)
    for wrong in ([b"short"], [hashes[0]] * 4):  # a bad length; more hashes than blocks
        bad = ticket_to_pb(ticket)
        del bad.block_hashes[:]
        bad.block_hashes.extend(wrong)
        with pytest.raises(InvalidInput, match="block_hashes"):
            ticket_from_pb(bad)


def test_prefix_metrics_count_what_the_cache_counted():
    metrics = WorkerMetrics()
    counts = dict.fromkeys(metrics.prefix_counters, 0)
    metrics.record_prefix({**counts, "hits": 2, "hit_tokens": 128})
    metrics.record_prefix({**counts, "hits": 3, "hit_tokens": 128, "misses": 1})
    text = metrics.render().decode()
    assert "pdxfer_prefix_hits_total 3.0" in text
    assert "pdxfer_prefix_hit_tokens_total 128.0" in text
    assert "pdxfer_prefix_misses_total 1.0" in text
