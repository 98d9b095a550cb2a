"""The packer caches what every plan between two instances shares (`packer.pairs`): a plan
made with the cache must equal, array for array, one made afresh, whatever was planned
before it: other requests, other token ranges, other layer groups, with or without the
state, other pairs of instances (some only a layout option apart).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.layouts import instance_layouts
from transfer.cache import ConvOrder, KVOrder, Layout
from transfer.packer import TransferPlan, TransferRequest, plan_transfer
from transfer.packer.pairs import clear_cache, instance_pair
from transfer.presets import get_preset

NUM_BLOCKS, NUM_SLOTS, STAGING = 24, 4, 1 << 14


def _instance(name: str, tp: int, block_size: int, **options) -> tuple[Layout, ...]:
    return instance_layouts(get_preset(name), tp, block_size, NUM_BLOCKS, NUM_SLOTS, STAGING,
                            **options)  # fmt: skip


def _copy(layouts: tuple[Layout, ...]) -> tuple[Layout, ...]:
    """Equal layouts that are other objects."""
    return tuple(Layout.from_dict(layout.to_dict()) for layout in layouts)


QWEN_2, QWEN_1 = _instance("tiny-qwen3-next", 2, 8), _instance("tiny-qwen3-next", 1, 8)
PAIRS = [
    (QWEN_2, QWEN_1),
    # A request fits each of these as it fits the first pair, but their plans differ: one
    # decode layout option apart, the same decode instance from another prefill one.
    (
        QWEN_2,
        _instance(
            "tiny-qwen3-next",
            1,
            8,
            kv_order=KVOrder.LAYER_FIRST,
            conv_order=ConvOrder.TIME_CHANNELS,
        ),
    ),
    (_instance("tiny-qwen3-next", 1, 8), QWEN_1),
    (QWEN_1, _instance("tiny-qwen3-next", 2, 4)),
    (_instance("tiny-kimi-linear", 2, 4), _instance("tiny-kimi-linear", 1, 8, layer_group=2)),
]
PAIRS.append(tuple(_copy(side) for side in PAIRS[0]))


@st.composite
def calls(draw):
    """(pair index, request, layers, tokens, with_state): one plan_transfer call."""
    index = draw(st.integers(0, len(PAIRS) - 1))
    prefill, decode = PAIRS[index]
    num_tokens = draw(st.integers(1, 40))
    blocks = [
        draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=n, max_size=n, unique=True))
        for n in (prefill[0].blocks_for(num_tokens), decode[0].blocks_for(num_tokens))
    ]
    num_slots = draw(st.integers(1, 2))
    slots = [
        draw(
            st.lists(
                st.integers(0, NUM_SLOTS - 1), min_size=num_slots, max_size=num_slots, unique=True
            )
        )
        for _ in range(2)
    ]
    request = TransferRequest(num_tokens, blocks[0], slots[0], blocks[1], slots[1])
    indices = [layer.index for layer in decode[0].geometry.layers]
    layers = draw(st.none() | st.frozensets(st.sampled_from(indices), min_size=1))
    bounds = st.integers(0, num_tokens)
    tokens = draw(st.none() | st.tuples(bounds, bounds).map(lambda t: tuple(sorted(t))))
    return index, request, layers, tokens, draw(st.booleans())


def _plan(call) -> tuple[TransferPlan, ...]:
    index, request, layers, tokens, with_state = call
    prefill, decode = PAIRS[index]
    return plan_transfer(
        prefill, decode, request, layers=layers, tokens=tokens, with_state=with_state
    )


def _assert_same(got: tuple[TransferPlan, ...], want: tuple[TransferPlan, ...]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        scalars = ("decode_rank", "num_tokens", "useful_bytes", "naive_descriptors")
        assert [getattr(g, f) for f in scalars] == [getattr(w, f) for f in scalars]
        assert len(g.sources) == len(w.sources)
        for gs, ws in zip(g.sources, w.sources, strict=True):
            for field in dataclasses.fields(gs):
                a, b = getattr(gs, field.name), getattr(ws, field.name)
                if field.name in ("wire", "gather", "scatter"):
                    for x, y in zip(a.arrays(), b.arrays(), strict=True):
                        assert x.dtype == y.dtype == np.int64
                        np.testing.assert_array_equal(x, y)
                else:
                    assert a == b, field.name


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(calls(), min_size=2, max_size=8))
def test_cached_plans_equal_fresh_ones(sequence):
    clear_cache()
    cached = [_plan(call) for call in sequence]  # each after the ones before, cached
    for call, plans in zip(sequence, cached, strict=True):
        clear_cache()
        _assert_same(plans, _plan(call))


def test_parts_of_a_request_do_not_share_copies():
    """The same pair and request, planned for another part (state or not, a layer group or
    all layers) right after: each plan equals its fresh one."""
    prefill, decode = PAIRS[0]
    request = TransferRequest(20, (3, 1, 7), (2,), (5, 0, 9), (1,))
    first_layers = frozenset(layer.index for layer in decode[0].geometry.layers[:3])
    parts = [(None, False), (None, True), (first_layers, True), (first_layers, False)]
    clear_cache()
    cached = [
        plan_transfer(prefill, decode, request, layers=layers, with_state=with_state)
        for layers, with_state in parts
    ]
    for (layers, with_state), plans in zip(parts, cached, strict=True):
        clear_cache()
        fresh = plan_transfer(prefill, decode, request, layers=layers, with_state=with_state)
        _assert_same(plans, fresh)


def test_pairs_do_not_share_copies():
    """Pairs a layout option apart get plans of their own; equal layouts that are other
    objects get a pair of their own, with equal plans."""
    request = TransferRequest(20, (3, 1, 7), (2,), (5, 0, 9), (1,))
    clear_cache()
    plans = [plan_transfer(prefill, decode, request) for prefill, decode in PAIRS[:3]]
    assert len({tuple(plan[0].ranges()) for plan in plans}) == 3
    for (prefill, decode), cached in zip(PAIRS[:3], plans, strict=True):
        clear_cache()
        _assert_same(cached, plan_transfer(prefill, decode, request))
    assert instance_pair(*PAIRS[0]) is not instance_pair(*PAIRS[-1])
    _assert_same(plan_transfer(*PAIRS[-1], request), plans[0])
