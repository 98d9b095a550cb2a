"""`verify`'s digests (`transfer/vllm/digests.py`) over caches exactly as vLLM allocates them:
at TP pairs whose heads divide, prefill ranks' tables match what decode ranks hold after the
planned reads (whole blocks, and the partial last block through stage slots); one flipped
byte of the request's cache on decode fails naming its unit, while bytes that are not the
request's (past its tokens in the last block) do not count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.vllm.test_vllm_layout import BLOCK, GROUPS, NUM_BLOCKS, _describe
from tests.vllm.test_vllm_stage_tail import Memory, _run, _scatter, _stale
from transfer.errors import InvalidInput
from transfer.vllm.digests import (
    RequestCache,
    compute,
    decode_table,
    digest_units,
    encode_table,
    mismatches,
    request_tag,
    table_bytes,
    unit_ranges,
)
from transfer.vllm.load_plan import plan_load
from transfer.vllm.metadata import DigestSpec, LoadSpec
from transfer.vllm.region_copies import RegionCopies
from transfer.vllm.stage_tail import gather_copies, slot_bytes
from transfer.vllm.ticket import Ticket
from transfer.vllm.worker_verify import CORRUPT_TOKENS_ENV, RankVerifier, digest_slot_bytes

SRC_IDS = [(0,), (1,), (2,), (3, 4)]
DST_IDS = [(4,), (3,), (2,), (1, 0)]
PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _digests(memory, flat, rank, block_ids, num_tokens):
    copies = RegionCopies([flat], memory.region_map)
    cache = RequestCache.of(GROUPS, block_ids, BLOCK, num_tokens)
    return compute(copies, memory.layout(rank), cache)


def _transfer(tp_p, tp_d, num_tokens):
    """Prefill ranks (random bytes, the tail gathered into a stage slot), each decode rank
    after its planned reads landed (a reference memcpy) and its tail scattered; returns
    (prefill tables, decode ranks as (memory, flat))."""
    partial = num_tokens % BLOCK
    sources, offsets, tables, layouts = [], [], [], []
    tag = request_tag("req", num_tokens)
    for p in range(tp_p):
        memory, flat, _, _ = _describe(tp_p, seed=20 + p)
        layout = memory.layout(p)
        source = Memory(memory.region_map, flat, 2 * slot_bytes(layout))
        at = source.extra_at + slot_bytes(layout)
        if partial:
            _run(gather_copies(layout, SRC_IDS[3][-1], partial, at), source, source)
        sources.append(source), offsets.append(at), layouts.append(layout)
        table = encode_table(tag, _digests(memory, flat, p, SRC_IDS, num_tokens))
        assert len(table) == table_bytes(layout)
        tables.append(decode_table(table, layout, tag))
    decodes = []
    for rank in range(tp_d):
        memory, flat, d_layers, _ = _describe(tp_d, seed=99)  # stale bytes everywhere
        _stale(d_layers[3][1], DST_IDS[3][-1])
        d_layouts = [memory.layout(r) for r in range(tp_d)]
        staged = offsets if partial else ()
        reads = plan_load(GROUPS, layouts, d_layouts, rank, SRC_IDS, DST_IDS, num_tokens, staged)
        decode = Memory(memory.region_map, flat, 1 << 20)
        tail = reads.tail.shifted(decode.extra_at)[0] if reads.tail else {}
        for p, columns in [*reads.per_source.items(), *tail.items()]:
            _run(columns, sources[p], decode)
        if reads.tail is not None:
            _scatter(reads.tail, decode)
        decodes.append((memory, flat, d_layers))
    return tables, decodes


@pytest.mark.parametrize("num_tokens", [699, 2 * BLOCK])  # a staged tail; full blocks only
@pytest.mark.parametrize("tp_p, tp_d", PAIRS)
def test_decode_digests_equal_the_prefill_tables(tp_p, tp_d, num_tokens):
    tables, decodes = _transfer(tp_p, tp_d, num_tokens)
    for rank, (memory, flat, _) in enumerate(decodes):
        digests = _digests(memory, flat, rank, DST_IDS, num_tokens)
        assert len(digests) == len(digest_units(memory.layout(rank)))
        assert mismatches(memory.layout(rank), digests, tables) == []


@pytest.mark.parametrize("tp_p, tp_d", [(1, 1), (2, 1), (1, 2)])
def test_a_flipped_byte_of_the_request_fails_naming_its_unit(tp_p, tp_d):
    num_tokens = 699
    tables, decodes = _transfer(tp_p, tp_d, num_tokens)
    memory, flat, d_layers = decodes[-1]
    rank = tp_d - 1
    layout = memory.layout(rank)
    cache = RequestCache.of(GROUPS, DST_IDS, BLOCK, num_tokens)
    ranges = unit_ranges(layout, cache)
    keys = digest_units(layout)
    base = flat.data_ptr()
    rng = np.random.default_rng(tp_p * 10 + tp_d)
    for i in rng.choice(len(keys), 4, replace=False).tolist():
        offsets, nbytes = ranges[i]
        j = int(rng.integers(len(offsets)))
        at = int(memory.region_map.addresses(offsets[j : j + 1], nbytes[j : j + 1], "at")[0])
        at += int(rng.integers(nbytes[j])) - base
        flat[at] ^= 0x10
        problems = mismatches(layout, _digests(memory, flat, rank, DST_IDS, num_tokens), tables)
        layer, tensor, segment, unit = keys[i]
        assert problems == [f"layer {layer} {tensor} segment {segment} unit {unit}: differs"]
        flat[at] ^= 0x10
    # Not the request's bytes: its last block past its tokens.
    attention = d_layers[3][1]  # [blocks, heads, block_size, K|V] as vLLM allocated it
    assert attention.shape[0] == NUM_BLOCKS
    last_head_run = attention[DST_IDS[3][-1], -1].view(torch.uint8)
    last_head_run[-1, -1] ^= 0xFF  # V of the block's last token (past 699 % 384)
    assert mismatches(layout, _digests(memory, flat, rank, DST_IDS, num_tokens), tables) == []


def test_a_table_of_another_request_or_size_is_refused():
    memory, flat, _, _ = _describe(1, seed=3)
    layout = memory.layout(0)
    table = encode_table(request_tag("a", 699), _digests(memory, flat, 0, SRC_IDS, 699))
    assert decode_table(table, layout, request_tag("a", 699))
    with pytest.raises(InvalidInput, match="not this request's"):
        decode_table(table, layout, request_tag("b", 699))
    with pytest.raises(InvalidInput, match="digest table of"):
        decode_table(table[:-8], layout, request_tag("a", 699))


def test_the_workers_table_round_trip_and_the_corrupt_hook(monkeypatch):
    """Prefill's `RankVerifier` writes the table into a slot; decode's checks the landed
    cache against it, and with the test hook set for this token count, flips a byte first."""
    num_tokens = 699
    prefill_memory, prefill_flat, _, _ = _describe(1, seed=5)
    layout = prefill_memory.layout(0)
    prefill = RankVerifier(GROUPS, layout, RegionCopies([prefill_flat], prefill_memory.region_map))
    slot = torch.zeros(digest_slot_bytes(layout), dtype=torch.uint8)
    prefill.write_table(DigestSpec("req-9", tuple(SRC_IDS), num_tokens, 3), slot)
    decode_memory, decode_flat, _, _ = _describe(1)
    source = Memory(prefill_memory.region_map, prefill_flat, 0)
    target = Memory(decode_memory.region_map, decode_flat, 0)
    reads = plan_load(GROUPS, [layout], [decode_memory.layout(0)], 0, SRC_IDS, DST_IDS, num_tokens)
    _run(reads.per_source[0], source, target)
    ticket = Ticket("127.0.0.1:1", "req-9", tuple(SRC_IDS), num_tokens, 1, "hash")
    load = LoadSpec("decode-req", ticket, tuple(DST_IDS), num_tokens)
    tables = [slot[: table_bytes(layout)].numpy()]
    copies = RegionCopies([decode_flat], decode_memory.region_map)
    assert RankVerifier(GROUPS, decode_memory.layout(0), copies).check(load, [layout], tables) == []
    monkeypatch.setenv(CORRUPT_TOKENS_ENV, str(num_tokens))
    problems = RankVerifier(GROUPS, decode_memory.layout(0), copies).check(load, [layout], tables)
    assert len(problems) == 1 and problems[0].endswith("differs")
