"""docs/bugs.md #4 and #6: transferred state is never reset, filling slots are never touched."""

from __future__ import annotations

import pytest
import torch

from transfer.geometry import Role
from transfer.model.caches import LocalCaches
from transfer.model.reference import reference_generate, reference_model
from transfer.model.runner import RankEngine
from transfer.model.slots import CacheFillingError, SlotPhase
from transfer.presets import get_preset

PROMPT = [11, 400, 23, 5, 97, 310, 2, 64, 128, 7, 19, 333]
BLOCK_SIZE = 8
NEW_TOKENS = 4


def make_engine(geometry, num_blocks=8, num_slots=3):
    caches = LocalCaches(
        geometry, num_blocks=num_blocks, block_size=BLOCK_SIZE, num_slots=num_slots
    )
    return RankEngine(geometry, caches, model=reference_model(geometry))


def copy_request(geometry, src, src_blocks, src_slot, dst, dst_blocks, dst_slot):
    """What a same-TP transfer does: KV block by block, S&Conv slot to slot."""
    for layer in geometry.layers:
        for tensor in layer.cache_tensors():
            if tensor.role is Role.KV:
                s, d = src.kv(layer.index, tensor.name), dst.kv(layer.index, tensor.name)
                for sb, db in zip(src_blocks, dst_blocks[: len(src_blocks)], strict=True):
                    d[db].copy_(s[sb])
            elif tensor.role is Role.SSM:
                dst.ssm(layer.index)[dst_slot].copy_(src.ssm(layer.index)[src_slot])
            else:
                d = dst.conv(layer.index, tensor.name)
                d[dst_slot].copy_(src.conv(layer.index, tensor.name)[src_slot])


def snapshot(caches: LocalCaches) -> dict:
    return {key: t.clone() for key, t in caches.tensors.items()}


def assert_same(before: dict, caches: LocalCaches) -> None:
    for key, t in caches.tensors.items():
        assert torch.equal(before[key], t), f"cache {key} changed"


@pytest.fixture(scope="module", params=["tiny-qwen3-next", "tiny-kimi-linear", "tiny-nemotron-h"])
def geometry(request):
    return get_preset(request.param)


@pytest.fixture(scope="module")
def prefilled(geometry):
    """A prefill engine that ran PROMPT into blocks [5, 2] and slot 0."""
    engine = make_engine(geometry)
    first = engine.prefill(PROMPT, [5, 2], 0)
    return engine, first


def test_bug4_transferred_state_survives_arrival_and_decode(geometry, prefilled):
    p_engine, first = prefilled
    d_engine = make_engine(geometry)
    d_blocks, d_slot = [6, 0, 3], 1
    d_engine.mark_filling(d_slot, d_blocks)
    copy_request(geometry, p_engine.caches, [5, 2], 0, d_engine.caches, d_blocks, d_slot)
    arrived = snapshot(d_engine.caches)
    d_engine.mark_ready(d_slot)
    assert_same(arrived, d_engine.caches)  # arrival resets nothing
    tokens = d_engine.decode(first, len(PROMPT), d_blocks, d_slot, NEW_TOKENS)
    assert [first] + tokens == reference_generate(geometry, PROMPT, NEW_TOKENS + 1)


def test_bug4_a_reset_on_arrival_would_be_caught(geometry, prefilled):
    """The negative control: the decode really depends on the transferred linear state."""
    p_engine, first = prefilled
    d_engine = make_engine(geometry)
    d_engine.mark_filling(0, [0, 1, 2])
    copy_request(geometry, p_engine.caches, [5, 2], 0, d_engine.caches, [0, 1, 2], 0)
    d_engine.mark_ready(0)
    good = d_engine.decode_step_logits(first, len(PROMPT), [0, 1, 2], 0)
    d_engine.release(0)
    d_engine.mark_filling(0, [0, 1, 2])
    copy_request(geometry, p_engine.caches, [5, 2], 0, d_engine.caches, [0, 1, 2], 0)
    for layer in geometry.linear_layers:  # what the "new request" reset did
        d_engine.caches.ssm(layer.index)[0].zero_()
    d_engine.mark_ready(0)
    reset = d_engine.decode_step_logits(first, len(PROMPT), [0, 1, 2], 0)
    assert float((good - reset).abs().max()) > 1e-2 * float(good.abs().max())


def test_bug6_steps_refuse_a_filling_slot_and_its_blocks(geometry, prefilled):
    _, first = prefilled
    engine = make_engine(geometry)
    a_first = engine.prefill(PROMPT, [0, 1], 0)  # request A, live in slot 0
    engine.mark_filling(1, [2, 3, 4])  # request B arriving into slot 1
    before = snapshot(engine.caches)
    refused = [
        lambda: engine.decode_step(first, len(PROMPT), [2, 3, 4], 1),
        lambda: engine.decode(first, len(PROMPT), [2, 3, 4], 1, 2),
        lambda: engine.prefill(PROMPT, [2, 3], 1),
        lambda: engine.prefill(PROMPT, [5, 4], 2),  # another slot, but a filling block
        lambda: engine.decode_step(a_first, len(PROMPT), [0, 1, 3], 0),
        lambda: engine.mark_filling(2, [6, 3]),
    ]
    for call in refused:
        with pytest.raises(CacheFillingError):
            call()
    assert_same(before, engine.caches)
    assert engine.slot_phase(2) is SlotPhase.FREE
    assert engine.slot_phase(1) is SlotPhase.FILLING
    # Request A decodes on while B is in flight.
    engine.decode(a_first, len(PROMPT), [0, 1, 5], 0, 2)
    engine.mark_ready(1)
    assert engine.slot_phase(1) is SlotPhase.READY


def test_slot_lifecycle_errors(geometry):
    engine = make_engine(geometry, num_blocks=4, num_slots=2)
    with pytest.raises(ValueError, match="slot 0 is free, not filling"):
        engine.mark_ready(0)
    engine.prefill(PROMPT[:3], [0], 0)
    with pytest.raises(ValueError, match="prefill: slot 0 holds a live request"):
        engine.prefill(PROMPT[:3], [1], 0)
    with pytest.raises(ValueError, match="mark_filling: slot 0 holds a live request"):
        engine.mark_filling(0, [1])
    engine.release(0)
    with pytest.raises(ValueError, match="slot 0 holds no request state"):
        engine.decode_step(1, 3, [0], 0)
    engine.mark_filling(1, [2])
    engine.release(1)  # a failed transfer frees its slot and blocks
    engine.prefill(PROMPT[:3], [2], 1)
    with pytest.raises(ValueError, match=r"block_ids: block ids must be ints in \[0, 4\)"):
        engine.mark_filling(0, [9])
