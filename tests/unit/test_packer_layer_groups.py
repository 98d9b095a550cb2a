"""Layer groups: the layout's streaming groups, and `plan_transfer(layers=...)` per group.

The plans of all groups together move exactly the bytes of the whole-request plan (run on
byte arrays), never a byte twice, and each group's plan touches only its layers' caches.
With grouped layouts a group costs a handful of ranges; without, a group of a head-major
layout is strided per token, which is why the layout option exists.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transfer.cache import Layout, LayoutOptions
from transfer.cache.head_units import layer_group_of
from transfer.errors import InvalidInput
from transfer.packer import StagingPolicy, TransferRequest, plan_transfer
from transfer.presets import get_preset

BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS = 8, 24, 3
DIRECT = StagingPolicy(enabled=False)
PRESETS = ["tiny-qwen3-next", "tiny-kimi-linear", "tiny-nemotron-h"]


def _layouts(name: str, tp: int, layer_group: int) -> tuple[Layout, ...]:
    options = LayoutOptions(layer_group=layer_group)
    return Layout(
        get_preset(name), tp, 0, BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS, options=options
    ).all_ranks()


def _groups(name: str, layer_group: int) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for layer in get_preset(name).layers:
        groups.setdefault(layer_group_of(layer.index, layer_group), []).append(layer.index)
    return list(groups.values())


def _request(tokens: int, seed: int) -> TransferRequest:
    rng = np.random.default_rng(seed)
    need = -(-tokens // BLOCK_SIZE)
    src, dst = (tuple(int(b) for b in rng.permutation(NUM_BLOCKS)[:need]) for _ in range(2))
    return TransferRequest(tokens, src, (int(rng.integers(NUM_SLOTS)),), dst, (1,))


def _run(plans, p_arenas, d_arenas, written) -> None:
    for plan in plans:
        for p, src, dst, n in plan.ranges():
            assert not written[plan.decode_rank][dst : dst + n].any(), "a byte moved twice"
            written[plan.decode_rank][dst : dst + n] = True
            d_arenas[plan.decode_rank][dst : dst + n] = p_arenas[p][src : src + n]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(PRESETS),
    tps=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2)]),
    layer_group=st.sampled_from([0, 1, 2, 3]),
    tokens=st.integers(1, NUM_BLOCKS * BLOCK_SIZE // 2),
    seed=st.integers(0, 2**16),
)
def test_the_groups_together_move_exactly_the_whole_request(name, tps, layer_group, tokens, seed):
    p, d = tps
    if p not in get_preset(name).valid_tps((p,)) or d not in get_preset(name).valid_tps((d,)):
        return
    prefill, decode = _layouts(name, p, layer_group), _layouts(name, d, layer_group)
    request = _request(tokens, seed)
    rng = np.random.default_rng(seed)
    p_arenas = [rng.integers(1, 256, lay.arena_bytes, dtype=np.uint8) for lay in prefill]
    whole = [np.zeros(lay.arena_bytes, np.uint8) for lay in decode]
    grouped = [np.zeros(lay.arena_bytes, np.uint8) for lay in decode]
    plans = plan_transfer(prefill, decode, request, DIRECT)
    _run(plans, p_arenas, whole, [np.zeros(lay.arena_bytes, bool) for lay in decode])
    written = [np.zeros(lay.arena_bytes, bool) for lay in decode]
    group_plans = [
        plan_transfer(prefill, decode, request, DIRECT, layers=group)
        for group in _groups(name, layer_group)
    ]
    for group in group_plans:
        _run(group, p_arenas, grouped, written)
    for a, b in zip(whole, grouped, strict=True):
        assert np.array_equal(a, b)
    for group in group_plans:  # what each group reports is what it moves
        assert sum(pl.useful_bytes for pl in group) == sum(pl.wire_bytes for pl in group)
    assert sum(pl.useful_bytes for g in group_plans for pl in g) == sum(
        pl.useful_bytes for pl in plans
    )


@pytest.mark.parametrize("name", PRESETS)
def test_a_group_plan_touches_only_its_layers(name):
    prefill, decode = _layouts(name, 1, 2), _layouts(name, 1, 2)
    first = _groups(name, 2)[0]
    owned = [
        (u.base, u.nbytes)
        for u in (*decode[0].kv_units(), *decode[0].state_units())
        if u.layer not in first
    ]
    plans = plan_transfer(prefill, decode, _request(30, 1), DIRECT, layers=first)
    assert plans[0].wire_bytes > 0
    tokens_end = decode[0].arena_bytes
    mask = np.zeros(tokens_end, bool)
    for _, _, dst, n in plans[0].ranges():
        mask[dst : dst + n] = True
    # No destination byte may be a unit base of another layer (a unit's first byte).
    assert not any(mask[base] for base, _ in owned if base < tokens_end)


def test_grouped_lanes_keep_a_group_to_a_few_ranges():
    """A head-major layout without groups interleaves every layer per token: one group of
    it is strided per token. Grouped lanes make it a run per block run again."""
    geometry = get_preset("qwen3-next-80b-a3b")
    request = TransferRequest(1024, tuple(range(64)), (1,), tuple(range(100, 164)), (2,))

    def group_descriptors(layer_group: int) -> int:
        layouts = Layout(
            geometry, 1, 0, 16, 200, 4, options=LayoutOptions(layer_group=layer_group)
        ).all_ranks()
        first = [layer.index for layer in geometry.layers if layer.index < 4]
        plans = plan_transfer(layouts, layouts, request, DIRECT, layers=first)
        return sum(plan.descriptors for plan in plans)

    assert group_descriptors(4) <= 4
    assert group_descriptors(0) >= 1024  # one per token at least


def test_layers_are_checked():
    layouts = _layouts("tiny-qwen3-next", 1, 0)
    request = _request(10, 0)
    for bad in ([], [999]):
        with pytest.raises(InvalidInput, match="layers"):
            plan_transfer(layouts, layouts, request, DIRECT, layers=bad)
    with pytest.raises(InvalidInput, match="layer_group"):
        LayoutOptions(layer_group=-1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(PRESETS),
    tps=st.sampled_from([(1, 1), (2, 1), (1, 2)]),
    layer_group=st.sampled_from([0, 2, 3]),
    tokens=st.integers(2, NUM_BLOCKS * BLOCK_SIZE // 2),
    cuts=st.lists(st.floats(0, 1), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_chunks_of_groups_move_exactly_the_whole_request(
    name, tps, layer_group, tokens, cuts, seed
):
    """A chunked prefill's order of work: each chunk's KV of each group, the state only
    with the last chunk. All parts together are the whole request, each byte once."""
    p, d = tps
    if p not in get_preset(name).valid_tps((p,)) or d not in get_preset(name).valid_tps((d,)):
        return
    prefill, decode = _layouts(name, p, layer_group), _layouts(name, d, layer_group)
    request = _request(tokens, seed)
    bounds = sorted({0, tokens, *(int(c * tokens) for c in cuts)})
    rng = np.random.default_rng(seed)
    p_arenas = [rng.integers(1, 256, lay.arena_bytes, dtype=np.uint8) for lay in prefill]
    whole = [np.zeros(lay.arena_bytes, np.uint8) for lay in decode]
    parts = [np.zeros(lay.arena_bytes, np.uint8) for lay in decode]
    _run(plan_transfer(prefill, decode, request, DIRECT), p_arenas, whole,
         [np.zeros(lay.arena_bytes, bool) for lay in decode])  # fmt: skip
    written = [np.zeros(lay.arena_bytes, bool) for lay in decode]
    for start, end in zip(bounds, bounds[1:], strict=False):
        last = end == tokens
        for group in _groups(name, layer_group):
            plans = plan_transfer(
                prefill, decode, request, DIRECT, layers=group, tokens=(start, end),
                with_state=last,
            )  # fmt: skip
            assert sum(pl.useful_bytes for pl in plans) == sum(pl.wire_bytes for pl in plans)
            _run(plans, p_arenas, parts, written)
    for a, b in zip(whole, parts, strict=True):
        assert np.array_equal(a, b)


def test_a_token_range_outside_the_request_is_refused():
    layouts = _layouts("tiny-qwen3-next", 1, 0)
    for bad in ((5, 3), (-1, 4), (0, 11)):
        with pytest.raises(InvalidInput, match="tokens"):
            plan_transfer(layouts, layouts, _request(10, 0), DIRECT, tokens=bad)
