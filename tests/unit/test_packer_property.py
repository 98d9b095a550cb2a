"""The core property: applying the plans with plain memcpy turns TP=P arenas into TP=D ones.

Random geometry (every kind), random P and D (not only pairs where one divides the other),
random layout options and dtypes on each side, different block sizes, fragmented pools,
speculative slots and staging policies. Each D rank's request bytes must equal what a TP=D
run holds, bit for bit; every other byte (staging areas aside) must be unchanged.
"""

from __future__ import annotations

import math
import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.packer_reference import check_transfer
from transfer.cache import (
    BlockPool,
    ConvOrder,
    KVOrder,
    Layout,
    LayoutOptions,
    SlotPool,
    SSMOrder,
    fragment,
)
from transfer.geometry import (
    GDNSpec,
    GQASpec,
    KDASpec,
    LayerSpec,
    Mamba2Spec,
    MLASpec,
    ModelGeometry,
)
from transfer.memplan import StatePlacement
from transfer.packer import StagingPolicy, TransferRequest, plan_transfer
from transfer.sizing import CacheDtypes

TPS = (1, 2, 3, 4, 6)


def _fits(units: int, tp: int) -> bool:
    return units % tp == 0 if units >= tp else tp % units == 0


@st.composite
def geometries(draw, p: int, d: int) -> ModelGeometry:
    lcm = math.lcm(p, d)
    split = st.integers(1, 2).map(lambda k: k * lcm)
    maybe_replicated = st.sampled_from(
        [u for u in range(1, 2 * lcm + 1) if _fits(u, p) and _fits(u, d)]
    )
    dim = st.integers(1, 3)
    kernel = st.integers(2, 4)
    kinds = {
        "gqa": st.builds(GQASpec, split, maybe_replicated, dim),
        "mla": st.builds(MLASpec, split, dim, dim, dim, dim),
        "gdn": st.builds(GDNSpec, split, split, dim, dim, kernel),
        "kda": st.builds(KDASpec, split, dim, kernel),
        "mamba2": st.builds(Mamba2Spec, split, dim, dim, maybe_replicated, kernel),
    }
    names = draw(st.lists(st.sampled_from(sorted(kinds)), min_size=1, max_size=4))
    layers = tuple(LayerSpec(i, draw(kinds[name])) for i, name in enumerate(names))
    return ModelGeometry("random", layers, hidden_size=8)


options = st.builds(
    LayoutOptions,
    st.sampled_from(list(KVOrder)),
    st.sampled_from(list(StatePlacement)),
    st.sampled_from(list(ConvOrder)),
    st.sampled_from(list(SSMOrder)),
)


def _allocate_blocks(num_blocks: int, need: int, rng: random.Random) -> list[int]:
    pool = BlockPool(num_blocks)
    held = fragment(pool, rng, fill=rng.random(), keep=rng.random(), max_request_blocks=3)
    while not pool.can_allocate(need):
        pool.free(held.pop())
    return pool.allocate(need)


def _allocate_slots(num_slots: int, spec: int, rng: random.Random) -> list[int]:
    pool = SlotPool(num_slots, spec)
    held = fragment(pool, rng, fill=rng.random(), keep=rng.random())
    while not pool.can_allocate():
        pool.free(held.pop())
    return pool.allocate()


@st.composite
def scenarios(draw):
    p, d = draw(st.sampled_from(TPS)), draw(st.sampled_from(TPS))
    geometry = draw(geometries(p, d))
    dtypes = draw(st.sampled_from([(2, 2, 2), (2, 4, 2), (4, 4, 4), (1, 4, 2), (2, 2, 4)]))
    tokens = draw(st.integers(1, 24))
    spec = draw(st.integers(0, 2))
    rng = random.Random(draw(st.integers(0, 2**32)))
    sides = []
    for tp in (p, d):
        block_size = draw(st.integers(1, 6))
        need = math.ceil(tokens / block_size) if geometry.attention_layers else 0
        num_blocks = need + draw(st.integers(0, 6))
        num_slots = (1 + spec) * draw(st.integers(1, 4))
        staging = draw(st.sampled_from([0, 64, 4096, 1 << 16]))
        layout = Layout(
            geometry,
            tp,
            0,
            block_size,
            num_blocks,
            num_slots,
            CacheDtypes(*dtypes),
            draw(options),
            staging_bytes=staging,
        )
        sides.append(
            (
                layout.all_ranks(),
                _allocate_blocks(num_blocks, need, rng),
                _allocate_slots(num_slots, spec, rng),
            )
        )
    (prefill, src_blocks, src_slots), (decode, dst_blocks, dst_slots) = sides
    request = TransferRequest(tokens, src_blocks, src_slots, dst_blocks, dst_slots)
    policy = StagingPolicy(
        enabled=draw(st.booleans()),
        small_bytes=draw(st.integers(1, 256)),
        min_small_ranges=draw(st.integers(1, 8)),
    )
    return prefill, decode, request, policy


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 2**32))
def test_plans_turn_tp_p_arenas_into_tp_d_arenas(scenario, seed):
    prefill, decode, request, policy = scenario
    plans = plan_transfer(prefill, decode, request, policy)
    assert check_transfer(prefill, decode, request, plans, np.random.default_rng(seed)) == []
    for plan in plans:
        assert plan.wire_bytes == plan.useful_bytes
        for source in plan.sources:
            assert source.wire.src.dtype == source.wire.dst.dtype == np.int64
            assert source.descriptors <= source.direct_descriptors
