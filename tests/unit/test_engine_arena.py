"""The engine over the real transfer arena (every layout order) equals it over plain tensors."""

from __future__ import annotations

import pytest
import torch

from transfer.cache.arena import Arena
from transfer.cache.head_units import ConvOrder, KVOrder
from transfer.cache.layout import Layout, LayoutOptions
from transfer.memplan import StatePlacement
from transfer.model.caches import ArenaCaches, CacheAccess, LocalCaches
from transfer.model.reference import reference_model
from transfer.model.runner import RankEngine
from transfer.presets import get_preset
from transfer.sizing import CacheDtypes

PROMPT = [9, 200, 31, 4, 480, 66, 123, 7, 301, 15, 2]
BLOCKS, SLOT = [2, 0, 3], 1
NEW_TOKENS = 3
FP32 = CacheDtypes(4, 4, 4)


def run(engine: RankEngine) -> torch.Tensor:
    logits = [engine.prefill_logits(PROMPT, BLOCKS, SLOT)]
    for i in range(NEW_TOKENS):
        token = int(logits[-1].argmax())
        logits.append(engine.decode_step_logits(token, len(PROMPT) + i, BLOCKS, SLOT))
    return torch.stack(logits)


def arena_engine(geometry, options: LayoutOptions, dtypes: CacheDtypes) -> RankEngine:
    layout = Layout(geometry, 1, 0, 8, 4, 2, dtypes, options)
    caches = ArenaCaches(Arena.allocate(layout))
    assert isinstance(caches, CacheAccess)
    return RankEngine(geometry, caches, model=reference_model(geometry))


@pytest.fixture(scope="module", params=["tiny-qwen3-next", "tiny-kimi-linear", "tiny-nemotron-h"])
def expected(request):
    geometry = get_preset(request.param)
    caches = LocalCaches(geometry, num_blocks=4, block_size=8, num_slots=2)
    return geometry, run(RankEngine(geometry, caches, model=reference_model(geometry)))


# Every value of each layout option at least once, in mixed combinations.
ORDERS = [
    (KVOrder.HEAD_MAJOR, ConvOrder.CHANNELS_TIME, StatePlacement.PER_REQUEST),
    (KVOrder.HEAD_MAJOR, ConvOrder.TIME_CHANNELS, StatePlacement.PER_LAYER),
    (KVOrder.BLOCKS_FIRST, ConvOrder.TIME_CHANNELS, StatePlacement.PER_REQUEST),
    (KVOrder.LAYER_FIRST, ConvOrder.CHANNELS_TIME, StatePlacement.PER_LAYER),
]


@pytest.mark.parametrize("kv_order, conv_order, placement", ORDERS, ids=lambda v: v.value)
def test_every_layout_order_computes_the_same(expected, kv_order, conv_order, placement):
    geometry, logits = expected
    options = LayoutOptions(kv_order, placement, conv_order)
    assert torch.equal(run(arena_engine(geometry, options, FP32)), logits)


def test_bf16_arena_decodes_close_to_fp32(expected):
    geometry, logits = expected
    got = run(arena_engine(geometry, LayoutOptions(), CacheDtypes(2, 4, 2)))
    assert torch.equal(got[0], logits[0])  # prefill logits never read the cache
    err = (got[1] - logits[1]).abs().max() / logits[1].abs().max()
    assert 0 < float(err) < 5e-2
