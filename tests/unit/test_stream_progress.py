"""Layer-wise streaming without processes: the progress words, and the decode planner fed
by real `ProgressWriter`s (one per prefill rank, each at its own pace) on byte arrays.

Whatever the ranks' interleaving and whenever decode looks, every planned READ covers only
bytes their prefill rank has published as final, no byte is read twice, and once the
planner is complete decode holds exactly what a whole-request transfer gives it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transfer.cache import Layout, LayoutOptions
from transfer.errors import InvalidInput
from transfer.packer import StagingPolicy, TransferRequest, plan_transfer
from transfer.presets import get_preset
from transfer.serving.engine.stream import StreamPlanner
from transfer.serving.ranks.progress import (
    WORDS,
    Progress,
    entry_offset,
    floor_word,
    next_key,
    progress_area_bytes,
    progress_word,
    read_entry,
    stream_groups,
    token_words,
)
from transfer.serving.ranks.stream_writer import ProgressWriter, StreamedChunk

BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS = 8, 24, 3
DIRECT = StagingPolicy(enabled=False)
PRESETS = ["tiny-qwen3-next", "tiny-kimi-linear", "tiny-nemotron-h"]


@given(
    key=st.integers(1, (1 << 22) - 1),
    chunk_end=st.integers(0, (1 << 32) - 1),
    groups=st.integers(0, 255),
    picked=st.booleans(),
    floor=st.integers(0, (1 << 32) - 1),
    token=st.integers(0, (1 << 31) - 1),
    logprob=st.floats(-1e4, 0.0, width=32),
)
def test_an_entry_reads_back_for_its_key_and_claims_nothing_for_another(
    key, chunk_end, groups, picked, floor, token, logprob
):
    words = (
        progress_word(key, chunk_end, groups, picked),
        floor_word(key, floor),
        *token_words(key, token, logprob),
    )
    assert all(-(1 << 63) <= w < 1 << 63 for w in words)  # each fits an int64 store
    first = (token, logprob)
    assert read_entry(words, key) == Progress(chunk_end, groups, picked, floor, first)
    assert read_entry(words, next_key(key)) == Progress()
    # words left by the slot's previous request count for nothing
    other = next_key(key)
    stale = (words[0], floor_word(other, floor), *token_words(other, token, logprob))
    assert read_entry(stale, key) == Progress(chunk_end, groups, picked)
    # a token whose logprob word is not in yet is not taken
    half = (*words[:3], token_words(other, token, logprob)[1])
    assert read_entry(half, key).first is None


def test_keys_skip_zero_and_never_repeat_the_previous_one():
    assert next_key(0) == 1
    assert next_key((1 << 22) - 1) == 1
    assert all(next_key(k) not in (0, k) for k in range(1, 5000))


def test_groups_leave_out_layers_without_caches():
    nemotron = get_preset("tiny-nemotron-h")
    groups = stream_groups(nemotron, 2)
    cached = sorted(layer.index for layer in nemotron.layers)
    assert [i for g in groups for i in g] == cached
    assert all(len({i // 2 for i in g}) == 1 for g in groups)
    assert stream_groups(nemotron, 0) == (tuple(cached),)
    layer = nemotron.layers[0]
    many = dataclasses.replace(
        nemotron, layers=tuple(dataclasses.replace(layer, index=i) for i in range(256))
    )
    assert len(stream_groups(many, 2)) == 128
    with pytest.raises(InvalidInput, match="stream_layers"):
        stream_groups(many, 1)


def _layouts(name: str, tp: int, layer_group: int) -> tuple[Layout, ...]:
    options = LayoutOptions(layer_group=layer_group)
    progress = progress_area_bytes(NUM_SLOTS)
    layout = Layout(
        get_preset(name), tp, 0, BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS, options=options,
        progress_bytes=progress,
    )  # fmt: skip
    return layout.all_ranks()


def _mark(masks, plans, rank: int) -> None:
    for plan in plans:
        for p, src, _, n in plan.ranges():
            if p == rank:
                masks[p][src : src + n] = True


class _PrefillRank:
    """One prefill rank: a real ProgressWriter over a byte arena, stepping through the
    prompt's chunks group by group, and the bytes it has published as final."""

    def __init__(self, layout, request, chunks, key, final_mask) -> None:
        self.arena = torch.zeros(layout.arena_bytes, dtype=torch.uint8)
        self.writer = ProgressWriter(self.arena, layout)
        self.layout, self.request, self.key = layout, request, key
        self.final = final_mask
        groups = len(self.writer.groups)
        self.events = [(c, g) for c in chunks for g in [*range(groups), "step"]]
        self.position = 0

    def step(self, prefill, decode) -> None:
        (start, end), group = self.events[self.position]
        last = end == self.request.num_tokens
        chunk = StreamedChunk(self.request.src_slots[0], self.key, start, end,
                              self.request.src_blocks, last)  # fmt: skip
        rank = self.layout.rank
        if group == "step":
            self.writer.stepped([chunk], [(7, -0.5)])
        else:
            members = self.writer.groups[group]
            plans = plan_transfer(prefill, decode, self.request, DIRECT, layers=members,
                                  tokens=(start, end), with_state=last)  # fmt: skip
            _mark(self.final, plans, rank)  # final before the word says so
            self.writer.after_layer([chunk])(members[-1])
        self.position += 1

    @property
    def done(self) -> bool:
        return self.position == len(self.events)

    def entry(self) -> list[int]:
        at = entry_offset(self.layout, self.request.src_slots[0])
        return self.arena[at : at + 8 * WORDS].view(torch.int64).tolist()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(PRESETS),
    tps=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2)]),
    layer_group=st.sampled_from([0, 1, 2, 3]),
    tokens=st.integers(1, NUM_BLOCKS * BLOCK_SIZE // 2),
    cuts=st.lists(st.floats(0.05, 0.95), max_size=3),
    reused_blocks=st.integers(0, 3),
    whole=st.booleans(),
    lead=st.integers(0, 1),
    seed=st.integers(0, 2**16),
)
def test_the_planner_reads_each_byte_once_and_only_after_every_rank_published_it(
    name, tps, layer_group, tokens, cuts, reused_blocks, whole, lead, seed
):
    p, d = tps
    geometry = get_preset(name)
    if p not in geometry.valid_tps((p,)) or d not in geometry.valid_tps((d,)):
        return
    prefill, decode = _layouts(name, p, layer_group), _layouts(name, d, layer_group)
    rng = np.random.default_rng(seed)
    need = -(-tokens // BLOCK_SIZE)
    src, dst = (tuple(int(b) for b in rng.permutation(NUM_BLOCKS)[:need]) for _ in range(2))
    request = TransferRequest(tokens, src, (int(rng.integers(NUM_SLOTS)),), dst, (1,))
    reused = min(reused_blocks * BLOCK_SIZE, (tokens - 1) // BLOCK_SIZE * BLOCK_SIZE)
    bounds = sorted({0, tokens, *(max(1, int(c * tokens)) for c in cuts)})
    chunks = list(zip(bounds, bounds[1:], strict=False))
    key = int(rng.integers(1, 1 << 22))

    final = [np.zeros(lay.arena_bytes, bool) for lay in prefill]
    ranks = [_PrefillRank(lay, request, chunks, key, final) for lay in prefill]
    data = [rng.integers(1, 256, lay.arena_bytes, dtype=np.uint8) for lay in prefill]
    got = [np.zeros(lay.arena_bytes, np.uint8) for lay in decode]
    written = [np.zeros(lay.arena_bytes, bool) for lay in decode]
    planner = StreamPlanner(prefill, decode, request, key, reused_tokens=reused, whole=whole)
    reads = 0
    while not planner.complete:
        behind = [r for r in ranks if not r.done]
        if behind and rng.random() < 0.7:
            # one rank runs ahead of the others most of the time
            ahead = [r for r in behind if r.layout.rank == lead % p]
            pick = ahead[0] if ahead and rng.random() < 0.8 else behind[-1]
            pick.step(prefill, decode)
            continue
        reads += 1
        words = [w for r in ranks for w in r.entry()]
        more = planner.advance(words)
        assert not (whole and more is not None and not all(r.done for r in ranks))
        for rank, rank_reads in enumerate(more or ()):
            for batch in rank_reads.batches:
                for local, remote, n in zip(batch.local, batch.remote, batch.nbytes, strict=True):
                    source = batch.prefill_rank
                    assert final[source][remote : remote + n].all(), "read before final"
                    assert not written[rank][local : local + n].any(), "a byte read twice"
                    written[rank][local : local + n] = True
                    got[rank][local : local + n] = data[source][remote : remote + n]
        assert reads < 10_000
    assert planner.first_pick == (7, -0.5)
    expected = [np.zeros(lay.arena_bytes, np.uint8) for lay in decode]
    part = {"tokens": (reused, tokens)} if reused else {}
    for plan in plan_transfer(prefill, decode, request, DIRECT, **part):
        for source, s, t, n in plan.ranges():
            expected[plan.decode_rank][t : t + n] = data[source][s : s + n]
    for want, have in zip(expected, got, strict=True):
        assert np.array_equal(want, have)
    whole_plans = plan_transfer(prefill, decode, request, DIRECT, **part)
    assert planner.kv_bytes == sum(p.kv_bytes for p in whole_plans)
    assert planner.state_bytes == sum(p.state_bytes for p in whole_plans)


def test_a_rank_that_lags_holds_back_every_part_until_it_publishes_it():
    prefill, decode = _layouts("tiny-qwen3-next", 2, 2), _layouts("tiny-qwen3-next", 1, 2)
    request = TransferRequest(40, (0, 1, 2, 3, 4), (0,), (5, 6, 7, 8, 9), (1,))
    final = [np.zeros(lay.arena_bytes, bool) for lay in prefill]
    ranks = [_PrefillRank(lay, request, [(0, 20), (20, 40)], 5, final) for lay in prefill]
    planner = StreamPlanner(prefill, decode, request, 5)
    while not ranks[0].done:
        ranks[0].step(prefill, decode)
    words = [w for r in ranks for w in r.entry()]
    assert planner.advance(words) is None  # rank 1 has published nothing
    ranks[1].step(prefill, decode)  # its first group of the first chunk
    words = [w for r in ranks for w in r.entry()]
    reads = planner.advance(words)
    assert reads is not None and planner.read_to[0] == 20 and planner.read_to[1:] == [0] * 3
    assert not any(planner.state_read) and not planner.complete
