"""The prefix cache's checkpoint policy and its plumbing below the workers: where a prompt
saves its state, the prefill engine ending chunks there and asking the cache for slots, the pools
allocating behind a hit and evicting for room, the memory plan's checkpoint slots, and the
ticket's cached_tokens on the wire."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.prefill_fakes import TIMEOUT_S, fake_instance
from transfer.cache.block_hashes import block_hashes
from transfer.cache.pools import CacheFullError, CachePools
from transfer.cache.prefix_cache import PrefixCache
from transfer.control.convert import ticket_from_pb, ticket_to_pb
from transfer.control.metrics import WorkerMetrics
from transfer.control.types import PrefillRequest, Ticket
from transfer.errors import InvalidInput, PdxferError
from transfer.memplan import plan_memory
from transfer.presets import get_preset
from transfer.serving.engine.checkpoints import PREFIX_UNIT, checkpoint_positions, checkpoint_stops
from transfer.serving.engine.prefill_engine import PrefillEngine


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


@pytest.fixture
def engine_with_prefix():
    made = []

    def _make(worker_fails: bool = False):
        instance, worker = fake_instance(1000, prefix_cache=True, state_checkpoints=3,
                                         checkpoint_interval=PREFIX_UNIT)  # fmt: skip
        if worker_fails:
            worker.broken_slot = 0
        engine = PrefillEngine(instance, "prefill-prefix", "127.0.0.1:1", 30.0)
        made.append(engine)
        return engine, worker

    yield _make
    for engine in made:
        engine.close()


def chunks_of(worker) -> list[tuple[int, int]]:
    return [(context, n) for step in worker.steps for _, context, n in step]


def test_the_engine_ends_chunks_at_checkpoints_and_a_hit_restores_in_its_first_chunk(
    engine_with_prefix,
):
    engine, worker = engine_with_prefix()
    cache, prompt = engine.instance.prefix, tuple(range(200))
    first = engine.submit(PrefillRequest("r", prompt, 4)).out.get(timeout=TIMEOUT_S)
    assert chunks_of(worker) == [(0, 64), (64, 64), (128, 64), (192, 8)]
    hashes = block_hashes(prompt, PREFIX_UNIT)
    saved = [cache.checkpoint_of(h) for h in hashes[:3]]
    assert sorted(saved) == [4, 5, 6]  # the three checkpoint slots past the 4 request slots
    engine.store.abort("r", "test")
    # the same prompt again: its first 192 tokens are a hit, restored in its only chunk
    worker.steps.clear()
    again = engine.submit(PrefillRequest("s", prompt, 4)).out.get(timeout=TIMEOUT_S)
    assert chunks_of(worker) == [(192, 8)]
    assert worker.chunks[-1].restore_from == cache.checkpoint_of(hashes[2])
    assert again.cached_tokens == 192 and again.first_token == first.first_token
    engine.store.abort("s", "test")
    assert engine.settle(TIMEOUT_S)
    assert engine.instance.pools.slots.num_free == 4


def test_a_failed_step_gives_its_reserved_checkpoint_back(engine_with_prefix):
    engine, _ = engine_with_prefix(worker_fails=True)
    outcome = engine.submit(PrefillRequest("r", tuple(range(64)), 4)).out.get(timeout=TIMEOUT_S)
    assert isinstance(outcome, PdxferError) and "broke midway" in str(outcome)
    cache = engine.instance.prefix
    assert sorted(cache.reserve_checkpoint(bytes([i]) * 16) for i in range(3)) == [4, 5, 6]


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
