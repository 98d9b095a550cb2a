"""The prefill prefix cache between real rank processes: a prompt that extends a cached one
restores the state checkpoint, computes only the rest, and leaves decode with the same bits
as a fresh full prefill on an instance without the cache. Both architectures the issue
names: Qwen3-Next (GDN + gated attention) and Kimi-Linear (KDA + MLA).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.support.worker_sides import (  # noqa: F401 (fixture)
    Side,
    one_thread,
    prompt,
    start_decode,
    start_prefill,
)
from transfer.control.client import ClientOptions
from transfer.control.types import DecodeRequest, GenerateRequest, PrefillRequest
from transfer.model.reference import reference_generate
from transfer.presets import get_preset
from transfer.serving.engine.checkpoints import PREFIX_UNIT
from transfer.serving.engine.instance import InstanceConfig
from transfer.serving.engine.prefill import PrefillWorker
from transfer.serving.launch.verify import check_request, load_side
from transfer.serving.openai.router import Router

pytestmark = pytest.mark.slow

MAX_TOKENS = 4


def prefill_side(model: str, tp: int, dump_dir: Path, cached: bool, name: str) -> Side:
    config = InstanceConfig(
        "prefill", get_preset(model), tp=tp, budget_bytes=16 << 20, max_seqs=2,
        dump_dir=str(dump_dir), prefix_cache=cached, state_checkpoints=2, staging_bytes=0,
        agent_prefix=f"{name}-{os.getpid()}",  # two prefill instances in this process
    )  # fmt: skip
    return start_prefill(config, name)


def decode_side(model: str, tp: int, dump_dir: Path, cached: bool, name: str, prefills) -> Side:
    config = InstanceConfig(
        "decode", get_preset(model), tp=tp, budget_bytes=16 << 20, max_seqs=2,
        dump_dir=str(dump_dir), prefix_cache=cached, staging_bytes=0,
        agent_prefix=f"{name}-{os.getpid()}",
    )  # fmt: skip
    return start_decode(config, name, prefills)


# (model, prefill TP, decode TP): both architectures at P=D=1, and each across TP degrees,
# where the suffix-only transfer re-slices heads.
SETUPS = [
    ("tiny-qwen3-next", 1, 1),
    ("tiny-kimi-linear", 1, 1),
    ("tiny-qwen3-next", 2, 1),
    ("tiny-kimi-linear", 1, 2),
]


@pytest.fixture(scope="module", params=SETUPS, ids=lambda s: f"{s[0]}-P{s[1]}D{s[2]}")
def sides(request, tmp_path_factory):
    """(model, cached prefill, plain prefill, cached decode, plain decode, dump dir)."""
    model, p, d = request.param
    dump_dir = tmp_path_factory.mktemp("caches")
    cached = prefill_side(model, p, dump_dir, True, "prefill-cached")
    plain = prefill_side(model, p, dump_dir, False, "prefill-plain")
    decode = decode_side(model, d, dump_dir, True, "decode-cached", [cached, plain])
    fresh = decode_side(model, d, dump_dir, False, "decode-plain", [plain])
    yield model, cached, plain, decode, fresh, dump_dir
    for side in (fresh, decode, plain, cached):
        side.close()


def generate(prefill: Side, decode: Side, rid: str, ids: list[int]):
    """(ticket, tokens, first event)."""
    ticket = prefill.worker.prefill(PrefillRequest(rid, tuple(ids), MAX_TOKENS))
    events = list(decode.worker.decode(DecodeRequest(ticket, MAX_TOKENS)))
    return ticket, [e.token for e in events], events[0]


def cached_tokens_of(model: str, prefill: Side, decode: Side, rid: str, ids: list[int]) -> int:
    """Serve `ids`, check its tokens against the colocated reference, and return how many
    of its prompt tokens prefill found cached."""
    ticket, got, _ = generate(prefill, decode, rid, ids)
    assert got == reference_generate(get_preset(model), ids, MAX_TOKENS)
    return ticket.cached_tokens


def assert_idle(side: Side) -> None:
    """Every block is free or the cache's; every request slot is free; no ticket lives."""
    if isinstance(side.worker, PrefillWorker):
        assert side.worker.settle(), "prefill frees still running after 30 s"
    pools, prefix = side.instance.pools, side.instance.prefix
    cached = prefix.stats().cached_blocks if prefix is not None else 0
    assert pools.blocks.num_free + cached == pools.blocks.num_total
    assert pools.slots.num_free == pools.slots.num_total
    if isinstance(side.worker, PrefillWorker):
        assert len(side.worker.store) == 0


def decode_caches(dump_dir: Path, rid: str) -> dict:
    """Every decode rank's snapshot, keyed by rank and tensor."""
    ranks = load_side(dump_dir, rid, "decode")
    return {(rank, key): t for rank, snap in enumerate(ranks) for key, t in snap.items()}


def test_an_extended_prompt_hits_on_both_sides_and_matches_a_fresh_run(sides):
    model, cached, plain, decode, fresh_decode, dump_dir = sides
    geometry = get_preset(model)
    align, block = PREFIX_UNIT, cached.instance.block_size
    # The hit ends 64 tokens into a block (one of 128 or 256): that block's rows are copied
    # on write, and decode still holds the whole block before it.
    hit_at = block + align
    first = prompt(1, hit_at + 5)
    turn = first + prompt(2, align // 2)

    ticket, _, event = generate(cached, decode, "turn-1", first)
    assert ticket.cached_tokens == event.reused_decode_tokens == 0
    whole_kv = event.kv_bytes
    ticket, hit_tokens, event = generate(cached, decode, "turn-2", turn)
    assert ticket.cached_tokens == hit_at  # the checkpoint at the first prompt's end
    held = len(first) // block * block  # turn 1's full prompt blocks stay on decode
    assert event.cached_prompt_tokens == hit_at and event.reused_decode_tokens == held
    _, fresh_tokens, fresh_event = generate(plain, fresh_decode, "turn-2-fresh", turn)
    # only the KV after the held blocks moved; the state crossed whole
    kv_per_token = fresh_event.kv_bytes / len(turn)
    assert event.kv_bytes == round(kv_per_token * (len(turn) - held)) < whole_kv
    assert event.state_bytes == fresh_event.state_bytes

    assert hit_tokens == fresh_tokens == reference_generate(geometry, turn, MAX_TOKENS)
    hit, fresh = decode_caches(dump_dir, "turn-2"), decode_caches(dump_dir, "turn-2-fresh")
    assert hit.keys() == fresh.keys()
    different = [key for key in fresh if not torch.equal(fresh[key], hit[key])]
    assert different == []  # bit for bit, KV and state, on every rank
    p, d = len(cached.instance.layouts), len(decode.instance.layouts)
    assert check_request(geometry, dump_dir, "turn-2", p, d).problems == ()
    # A short suffix runs its projections over a few rows; padded to 16, they reduce as
    # inside a long pass (transfer/model/row_invariant.py), so its caches are exact too.
    short = first + prompt(8, 3)
    ticket, hit_tokens, _ = generate(cached, decode, "short", short)
    _, fresh_tokens, _ = generate(plain, fresh_decode, "short-fresh", short)
    assert ticket.cached_tokens == hit_at and hit_tokens == fresh_tokens
    hit, fresh = decode_caches(dump_dir, "short"), decode_caches(dump_dir, "short-fresh")
    different = [key for key in fresh if not torch.equal(fresh[key], hit[key])]
    assert different == []
    stats = cached.instance.prefix.stats()
    assert (stats.hits, stats.hit_tokens) == (2, 2 * hit_at)
    for side in sides[1:5]:
        assert_idle(side)


def test_a_prompt_diverging_inside_the_cached_prefix_hits_up_to_its_checkpoint(sides):
    model, cached, _, decode, _, _ = sides
    align = PREFIX_UNIT
    base = prompt(3, 3 * align)
    generate(cached, decode, "base", base)  # checkpoint at 3 * align only
    diverged = base[: 2 * align] + prompt(4, align)
    # no checkpoint at 2 * align: recomputed whole
    assert cached_tokens_of(model, cached, decode, "diverged", diverged) == 0
    extended = base + prompt(5, 3)
    assert cached_tokens_of(model, cached, decode, "extended", extended) == 3 * align
    assert_idle(cached)
    assert_idle(decode)


def test_an_evicted_prefix_misses_cleanly(sides):
    model, cached, _, decode, _, _ = sides
    align = PREFIX_UNIT
    base = prompt(6, 2 * align)
    generate(cached, decode, "to-evict", base)
    prefix = cached.instance.prefix
    assert prefix.evict(cached.instance.pools.blocks.num_total) > 0
    assert prefix.stats().cached_blocks == 0
    again = base + prompt(7, 9)
    assert cached_tokens_of(model, cached, decode, "after-evict", again) == 0
    assert_idle(cached)
    assert_idle(decode)


def test_the_router_sends_a_later_turn_where_its_prefix_is_cached(sides):
    model, cached, plain, decode, _, _ = sides
    # The router learns prefixes from the tickets' hashes, one per full KV block, so its
    # hint needs a whole block; the hit itself is still counted in 64-token units.
    block = cached.instance.block_size
    router = Router(
        [cached.address, plain.address], [decode.address], ClientOptions(timeout_s=60.0)
    )

    def first_event(rid: str, ids: list[int]):
        events = list(router.generate(GenerateRequest(rid, tuple(ids), MAX_TOKENS)))
        assert [e.token for e in events] == reference_generate(get_preset(model), ids, MAX_TOKENS)
        return events[0]

    a, b = prompt(11, block + 5), prompt(12, block + 5)
    try:
        first_event("a-1", a)  # in turn: the cached instance
        first_event("b-1", b)  # in turn: the plain one
        # In turn order, b's next turn would now go to the cached instance and a's to the
        # plain one; each goes back where its first turn's blocks are instead.
        later_b = first_event("b-2", b + prompt(13, 7))
        later_a = first_event("a-2", a + prompt(14, 7))
    finally:
        router.close()
    assert later_a.cached_prompt_tokens == (block + 5) // PREFIX_UNIT * PREFIX_UNIT
    assert later_b.cached_prompt_tokens == 0
    for side in (cached, plain, decode):
        assert_idle(side)
