"""The prefix cache's 64-token match unit against blocks of other sizes (issue 35, part 2)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.cache.block_hashes import block_hashes
from transfer.cache.pools import BlockPool
from transfer.cache.prefix_cache import PrefixCache

UNIT = 64


def _cached(block_size: int, prompt: list[int]) -> tuple[PrefixCache, list[int]]:
    """A cache holding `prompt`'s full units, with a checkpoint at every unit end."""
    pool = BlockPool(64)
    cache = PrefixCache(pool, block_size, range(32), unit=UNIT)
    table = pool.allocate(-(-len(prompt) // block_size), "first")
    hashes = block_hashes(prompt, UNIT)
    cache.insert_prompt(hashes, table)
    for h in hashes:
        cache.commit_checkpoint(h, cache.reserve_checkpoint(h))
    pool.free_request("first")
    return cache, table


@settings(max_examples=80, deadline=None)
@given(
    # the tiny presets' blocks are 112 to 256 tokens; hypothesis first found block 48 refused
    block_size=st.integers(1, 16).map(lambda n: 16 * n) | st.sampled_from([48, 112, 160]),
    cached_len=st.integers(1, 600),
    shared=st.integers(0, 600),
    extra=st.integers(1, 100),
)
def test_a_hit_reuses_every_shared_whole_unit(block_size, cached_len, shared, extra):
    shared = min(shared, cached_len)
    first = list(range(cached_len))
    second = first[:shared] + [10_000 + i for i in range(extra)]
    cache, table = _cached(block_size, first)
    hit = cache.match(block_hashes(second, UNIT), len(second) - 1, "second")
    expected = min(shared // UNIT, cached_len // UNIT, (len(second) - 1) // UNIT) * UNIT
    assert hit.num_tokens == expected
    whole = expected // block_size
    assert hit.block_ids == tuple(table[:whole])  # the rows of those tokens, shared
    if expected % block_size:
        assert hit.copy_from == table[whole]  # the partial block: copied, never shared
        cache.release_copy_source(hit.copy_from)
    else:
        assert hit.copy_from is None
    assert (hit.checkpoint_slot is None) == (expected == 0)


def test_decode_hits_whole_blocks_only():
    cache, table = _cached(128, list(range(224)))
    prompt = list(range(224)) + [7] * 32
    hit = cache.match(block_hashes(prompt, UNIT), 255, "d", needs_checkpoint=False)
    assert (hit.num_tokens, hit.block_ids, hit.copy_from) == (128, (table[0],), None)


def test_evicting_a_block_drops_the_units_it_holds():
    cache, _ = _cached(128, list(range(224)))  # units 0,1 in block 0; unit 2 in block 1
    assert cache.stats().cached_blocks == 2
    assert cache.evict(2) == 2
    assert cache.stats().checkpoints == 0
    hit = cache.match(block_hashes(list(range(256)), UNIT), 255, "x")
    assert hit.num_tokens == 0
