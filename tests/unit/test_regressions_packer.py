"""One named test per packer bug that shipped in SGLang or vLLM (docs/bugs.md #1, #2, #3, #7, #8, #9).

Where it helps, a test also shows that the byte check catches the bug's symptom: it
overlays the buggy copy on top of a correct transfer and expects a reported problem.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.packer_reference import apply_memcpy, check_transfer
from transfer.cache import Layout, LayoutOptions
from transfer.geometry import GDNSpec, GQASpec, KDASpec, LayerSpec, Mamba2Spec, ModelGeometry
from transfer.packer import StagingPolicy, TransferRequest, plan_transfer
from transfer.sizing import size_model


def _ranks(geometry, tp, block_size=4, num_blocks=8, num_slots=2, **kwargs):
    return Layout(geometry, tp, 0, block_size, num_blocks, num_slots, **kwargs).all_ranks()


def _check(geometry, p, d, apply=apply_memcpy, tokens=10, **kwargs):
    prefill, decode = _ranks(geometry, p, **kwargs), _ranks(geometry, d, **kwargs)
    blocks = [5, 2, 7][: prefill[0].blocks_for(tokens)]
    request = TransferRequest(tokens, blocks, [1], blocks[::-1], [0])
    plans = plan_transfer(prefill, decode, request)
    problems = check_transfer(prefill, decode, request, plans, np.random.default_rng(0), apply)
    return prefill, decode, plans, problems


def _whole_tensor_conv_bug(prefill, decode, p_slot=1, d_slot=0):
    """The bug: slice the concatenated conv channels as one head-sharded tensor."""

    def apply(plans, p_arenas, d_arenas):
        apply_memcpy(plans, p_arenas, d_arenas)
        for d in decode:
            p = prefill[d.rank * len(prefill) // d.tp]
            (src_unit, *_), (dst_unit, *_) = (x.tensor_state_units(0, "conv") for x in (p, d))
            ratio = d.tp // p.tp
            part = sum(u.nbytes for u in p.tensor_state_units(0, "conv")) // ratio
            width = min(part, sum(u.nbytes for u in d.tensor_state_units(0, "conv")))
            src = src_unit.base + p_slot * src_unit.slot_stride + (d.rank % ratio) * part
            dst = dst_unit.base + d_slot * dst_unit.slot_stride
            d_arenas[d.rank][dst : dst + width] = p_arenas[p.rank][src : src + width]

    return apply


@pytest.mark.parametrize(
    "spec", [GDNSpec(2, 4, 3, 2, 4), Mamba2Spec(4, 2, 3, 2, 4)], ids=["gdn-qkv", "mamba2-xBC"]
)
def test_bug1_conv_state_is_resliced_per_segment(spec):
    geometry = ModelGeometry("conv", (LayerSpec(0, spec),), 8)
    for p, d in [(1, 2), (2, 1), (1, 4) if isinstance(spec, Mamba2Spec) else (2, 2)]:
        prefill, decode, plans, problems = _check(geometry, p, d)
        assert problems == []
        if p < d:
            *_, buggy = _check(geometry, p, d, apply=_whole_tensor_conv_bug(prefill, decode))
            assert any("conv" in problem for problem in buggy)


def test_bug2_gqa_heads_map_to_holders_when_fewer_heads_than_decode_ranks():
    geometry = ModelGeometry("gqa", (LayerSpec(0, GQASpec(8, 2, 4)),), 8)
    for p, d in [(1, 4), (2, 8), (8, 2), (4, 8), (8, 4)]:
        _, decode, plans, problems = _check(geometry, p, d)
        assert problems == []
        for plan in plans:
            head = plan.decode_rank // (d // 2) if d > 2 else plan.decode_rank
            holders = range(head * p // 2, (head + 1) * p // 2) if p >= 2 else range(1)
            assert {s.prefill_rank for s in plan.sources} <= set(holders)
            assert len(plan.sources) == 1  # the head is read once, from one holder


def test_bug3_kimi_linear_state_keeps_all_four_tensors_and_every_shard():
    geometry = ModelGeometry("kda", (LayerSpec(0, KDASpec(4, 3, 4)),), 8)
    for p, d in [(4, 2), (1, 4), (2, 4), (4, 1)]:
        _, decode, plans, problems = _check(geometry, p, d)
        assert problems == []
        names = [u.tensor for u in decode[0].state_units()]
        assert sorted(set(names)) == ["conv_k", "conv_q", "conv_v", "ssm"]
        for plan in plans:
            assert plan.state_bytes == size_model(geometry, d).state_bytes_per_slot
            heads = range(plan.decode_rank * 4 // d, (plan.decode_rank + 1) * 4 // d)
            wanted = {h * p // 4 for h in heads}  # the prefill rank of every head: none skipped
            assert {s.prefill_rank for s in plan.sources} == wanted


def test_bug7_offsets_past_2_and_4_gib_stay_exact_int64():
    geometry = ModelGeometry(
        "big", (LayerSpec(0, GDNSpec(2, 2, 2, 2, 4)), LayerSpec(1, GQASpec(2, 2, 64))), 8
    )
    # ~5 GiB of KV blocks before the state region and the staging area; nothing is allocated.
    big = {"block_size": 16, "num_blocks": 1_400_000, "num_slots": 4, "staging_bytes": 2**20}
    prefill = _ranks(geometry, 1, options=LayoutOptions(conv_order="time_channels"), **big)
    decode = _ranks(geometry, 2, **big)
    assert prefill[0].state_offset > 2**32 and prefill[0].staging_offset > 2**32
    last = big["num_blocks"] - 1
    request = TransferRequest(20, [last, last - 7], [3], [last - 1, last - 3], [2])
    plans = plan_transfer(prefill, decode, request, StagingPolicy(min_small_ranges=1))
    for plan in plans:
        d_layout = decode[plan.decode_rank]
        for source in plan.sources:
            for ranges in (source.wire, source.gather, source.scatter):
                for array in ranges.arrays():
                    assert array.dtype == np.int64
            assert source.gather.dst[0] == prefill[0].staging_offset + (
                0 if plan.decode_rank == 0 else plans[0].sources[0].gather.nbytes
            )
            assert source.scatter.src[0] == d_layout.staging_offset
            assert (source.wire.dst + source.wire.lengths <= d_layout.arena_bytes).all()
        unit = d_layout.tensor_kv_units(1, "k")[0]
        expected = unit.base + (last - 1) * unit.block_stride  # Python ints: no overflow
        written = np.concatenate([r.dst for s in plan.sources for r in (s.wire, s.scatter)])
        assert expected > 2**32 and expected in set(written.tolist())


@pytest.mark.parametrize(
    "spec", [GQASpec(8, 1, 4), Mamba2Spec(8, 2, 2, 1, 3)], ids=["gqa-1-kv-head", "mamba2-1-group"]
)
def test_bug8_fewer_kv_heads_or_groups_than_ranks_is_not_a_division_by_zero(spec):
    geometry = ModelGeometry("few", (LayerSpec(0, spec),), 8)
    for p, d in [(8, 4), (1, 8), (8, 8), (2, 1)]:
        _, _, plans, problems = _check(geometry, p, d)
        assert problems == []
        sizing = size_model(geometry, d)
        assert all(plan.useful_bytes == sizing.request_bytes(10) for plan in plans)


def test_bug9_mamba2_single_group_b_and_c_read_at_their_own_offsets():
    geometry = ModelGeometry("m2", (LayerSpec(0, Mamba2Spec(4, 2, 3, 1, 4)),), 8)
    for p, d in [(2, 4), (4, 2), (1, 4), (4, 1)]:
        prefill, decode, plans, problems = _check(geometry, p, d)
        assert problems == []
        for plan in plans:
            d_units = {u.segment: u for u in decode[plan.decode_rank].tensor_state_units(0, "conv")}
            for segment in (1, 2):  # B, C: one replicated group on every rank
                assert d_units[segment].unit == 0
                p_unit = prefill[0].state_unit(0, "conv", segment, 0)
                assert p_unit.base != prefill[0].state_unit(0, "conv", 0, 0).base
