"""Deterministic packer tests: every preset x TP pair, descriptor counts, accounting, input checks."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from tests.support.layouts import instance_layouts
from tests.support.packer_reference import apply_memcpy, check_transfer
from transfer.agent.staging import Packed, StagingArea, check_copies, copy_within, gather_to_staging
from transfer.cache import CachePools, KVOrder, Layout, LayoutOptions
from transfer.geometry import GQASpec, LayerSpec, MLASpec, ModelGeometry
from transfer.memplan import plan_memory
from transfer.packer import Mode, StagingPolicy, TransferRequest, plan_transfer
from transfer.presets import PRESETS, get_preset
from transfer.serving.ranks.spec import Copies
from transfer.sizing import CacheDtypes, size_model

GIB = 2**30


def _geometry(name: str) -> ModelGeometry:
    """Tiny presets whole; real ones cut to their first linear and first attention layer."""
    geometry = get_preset(name)
    if name.startswith("tiny-"):
        return geometry
    layers = (geometry.linear_layers[0], geometry.attention_layers[0])
    return ModelGeometry(geometry.name, layers, geometry.hidden_size)


def _preset_pairs():
    for name in PRESETS:
        tps = get_preset(name).valid_tps((1, 2, 4, 8))
        for p, d in itertools.product(tps, tps):
            yield name, p, d


@pytest.mark.parametrize(("name", "p", "d"), list(_preset_pairs()))
def test_every_preset_and_tp_pair_moves_exact_bytes(name, p, d):
    geometry = _geometry(name)
    tokens = 45
    # Prefill blocks smaller on even pairs, larger on odd ones: both directions.
    p_bs, d_bs = (8, 16) if (p + d) % 2 == 0 else (16, 8)
    prefill = instance_layouts(geometry, p, p_bs, 8, 2)
    decode = instance_layouts(geometry, d, d_bs, 8, 2)
    rng = np.random.default_rng(p * 10 + d)
    src_blocks = rng.permutation(8)[: math.ceil(tokens / p_bs)].tolist()
    dst_blocks = rng.permutation(8)[: math.ceil(tokens / d_bs)].tolist()
    request = TransferRequest(tokens, src_blocks, [1], dst_blocks, [0])
    plans = plan_transfer(prefill, decode, request)
    assert check_transfer(prefill, decode, request, plans, rng) == []
    sizing = size_model(geometry, d)
    for plan in plans:
        # Replicated heads and the MLA latent are read once: wire bytes = what TP=D holds.
        assert plan.wire_bytes == plan.useful_bytes == sizing.request_bytes(tokens)


def _fresh_plan(name, p, d, tokens=4096, **options):
    geometry = get_preset(name)
    sides = []
    for tp in (p, d):
        memplan = plan_memory(geometry, tp, int(0.9 * 80 * GIB), 256)
        layout = Layout.from_memplan(
            geometry, tp, 0, memplan, options=LayoutOptions(**options), staging_bytes=64 << 20
        )
        cache = CachePools.from_plan(memplan).allocate("r", tokens)
        sides.append((layout.all_ranks(), cache))
    (prefill, src), (decode, dst) = sides
    request = TransferRequest(tokens, src.block_ids, src.slot_ids, dst.block_ids, dst.slot_ids)
    return plan_transfer(prefill, decode, request)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_qwen3_next_4096_tokens_at_p_equals_d_needs_at_most_4_descriptors(tp):
    plans = _fresh_plan("qwen3-next-80b-a3b", tp, tp)
    for plan in plans:
        assert plan.descriptors <= 4
        assert [s.prefill_rank for s in plan.sources] == [plan.decode_rank]
        assert plan.naive_descriptors > 100
    if tp == 1:
        assert plans[0].descriptors == 3  # two KV head lanes + one state slot


def test_head_major_kv_beats_layer_first_under_hetero_tp():
    # Nemotron: 8 KV heads, so a TP=4 decode rank needs half of a TP=2 prefill rank's heads.
    ours = _fresh_plan("nemotron-nano-12b-v2", 2, 4)
    layer_first = _fresh_plan("nemotron-nano-12b-v2", 2, 4, kv_order=KVOrder.LAYER_FIRST)
    for a, b in zip(ours, layer_first, strict=True):
        assert a.sources[0].direct_descriptors * 100 < b.sources[0].direct_descriptors


def test_mla_reads_spread_evenly_over_prefill_ranks():
    geometry = ModelGeometry("mla", (LayerSpec(0, MLASpec(8, 4, 2, 2, 2)),), 8)
    for p, d in [(4, 2), (2, 4), (4, 4), (8, 2), (2, 8), (4, 8)]:
        prefill, decode = (
            instance_layouts(geometry, p, 4, 8, 1),
            instance_layouts(geometry, d, 4, 8, 1),
        )
        plans = plan_transfer(prefill, decode, TransferRequest(17, range(5), [], range(5), []))
        counts = np.bincount([s.prefill_rank for plan in plans for s in plan.sources], minlength=p)
        assert all(len(plan.sources) == 1 for plan in plans)  # exactly one source each
        assert counts.max() - counts.min() <= 1 if d >= p else counts.max() == 1


def test_staging_gathers_small_ranges_and_falls_back_when_staging_is_small():
    geometry = get_preset("tiny-qwen3-next")
    request = TransferRequest(40, range(5), [0], range(5), [0])
    prefill = instance_layouts(geometry, 1, 8, 8, 2)
    decode = instance_layouts(geometry, 2, 8, 8, 2, kv_order=KVOrder.LAYER_FIRST)
    eager = StagingPolicy(small_bytes=4096, min_small_ranges=4)
    staged = plan_transfer(prefill, decode, request, eager)
    for plan in staged:
        (source,) = plan.sources
        assert source.mode in (Mode.STAGED, Mode.MIXED)
        assert source.descriptors < source.direct_descriptors
        assert source.gather.nbytes == source.scatter.nbytes
        assert "gathered into 1 wire range" in source.reason
    direct = plan_transfer(prefill, decode, request, StagingPolicy(enabled=False))
    assert all(s.mode is Mode.DIRECT for plan in direct for s in plan.sources)
    tiny_staging = instance_layouts(geometry, 2, 8, 8, 2, staging=64, kv_order=KVOrder.LAYER_FIRST)
    fallback = plan_transfer(prefill, tiny_staging, request, eager)
    for plan in fallback:
        assert plan.sources[0].mode is Mode.DIRECT
        assert "staging" in plan.sources[0].reason
    # Two decode ranks staging from one prefill rank use disjoint parts of its staging area.
    starts = [plan.sources[0].gather.dst[0] for plan in staged]
    assert starts[1] - starts[0] == staged[0].sources[0].gather.nbytes


def test_staging_with_the_pack_kernels_matches_memcpy():
    geometry = get_preset("tiny-nemotron-h")
    request = TransferRequest(30, [3, 0, 5, 1], [1], [2, 6, 4, 7], [0])
    prefill = instance_layouts(geometry, 2, 8, 8, 2)
    decode = instance_layouts(geometry, 4, 8, 8, 2, kv_order=KVOrder.BLOCKS_FIRST)
    plans = plan_transfer(
        prefill, decode, request, StagingPolicy(small_bytes=2048, min_small_ranges=2)
    )
    assert any(s.mode is not Mode.DIRECT for plan in plans for s in plan.sources)

    def copies(ranges) -> Copies:
        return Copies(ranges.src.copy(), ranges.dst.copy(), ranges.lengths.copy())

    def apply_with_kernels(plans, p_arenas, d_arenas):
        # The copies serving and `bench transfer` run, checked against each side's layout.
        for plan in plans:
            for source in plan.sources:
                p_arena = torch.from_numpy(p_arenas[source.prefill_rank])
                p_area = StagingArea.of(prefill[source.prefill_rank])
                gather_to_staging(p_arena, p_area, copies(source.gather))
        apply_memcpy(plans, p_arenas, d_arenas, steps=("wire",))
        for plan in plans:
            for source in plan.sources:
                d_arena = torch.from_numpy(d_arenas[plan.decode_rank])
                scatter = copies(source.scatter)
                if len(scatter):
                    check_copies(StagingArea.of(decode[plan.decode_rank]), scatter, Packed.SRC)
                    copy_within(d_arena, scatter.src, scatter.dst, scatter.nbytes)

    rng = np.random.default_rng(7)
    assert check_transfer(prefill, decode, request, plans, rng, apply=apply_with_kernels) == []


def test_plans_export_int64_ranges_and_report_keys():
    geometry = get_preset("tiny-kimi-linear")
    prefill, decode = (
        instance_layouts(geometry, 2, 64, 4, 2),
        instance_layouts(geometry, 4, 64, 4, 2),
    )
    (plan, *_) = plan_transfer(prefill, decode, TransferRequest(100, [1, 3], [1], [2, 0], [0]))
    src, dst, lengths = plan.sources[0].wire.arrays()
    assert src.dtype == dst.dtype == lengths.dtype == np.int64
    assert list(plan.ranges())[0][0] == plan.sources[0].prefill_rank
    report = plan.report()
    assert {"rank", "kv_bytes", "state_bytes", "sources"} <= set(report)
    assert {"prefill_rank", "bytes", "descriptors"} <= set(report["sources"][0])


GQA = ModelGeometry("gqa", (LayerSpec(0, GQASpec(4, 2, 4)),), 8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"src_blocks": [0, 1, 99]}, "src_blocks: block id 99 out of range"),
        ({"dst_blocks": [0, -1, 2]}, "dst_blocks: block id -1 out of range"),
        ({"src_blocks": [0, 1]}, "src_blocks: 2 blocks given"),
        ({"dst_blocks": [0, 1, 2, 3]}, "dst_blocks: 4 blocks given"),
        ({"dst_blocks": [0, 0, 1]}, "dst_blocks: duplicate"),
        ({"dst_slots": [0, 1]}, "unequal slot counts"),
        ({"src_slots": [9], "dst_slots": [0]}, "src_slots: slot id 9 out of range"),
        ({"num_tokens": 0}, "num_tokens must be"),
    ],
)
def test_bad_requests_are_rejected_naming_the_field(change, message):
    prefill, decode = instance_layouts(GQA, 1, 4, 8, 2), instance_layouts(GQA, 2, 4, 8, 2)
    fields = {
        "num_tokens": 10,
        "src_blocks": [0, 1, 2],
        "src_slots": [0],
        "dst_blocks": [3, 4, 5],
        "dst_slots": [1],
    }
    with pytest.raises(ValueError, match=message):
        plan_transfer(prefill, decode, TransferRequest(**(fields | change)))


def test_mismatched_layouts_are_rejected_naming_what_differs():
    request = TransferRequest(10, [0, 1, 2], [0], [0, 1, 2], [0])
    prefill = instance_layouts(GQA, 2, 4, 8, 2)
    other = ModelGeometry("gqa", (LayerSpec(0, GQASpec(4, 2, 8)),), 8)
    with pytest.raises(ValueError, match="geometry: decode has 'gqa'"):
        plan_transfer(prefill, instance_layouts(other, 2, 4, 8, 2), request)
    fp32 = Layout(GQA, 1, 0, 4, 8, 2, CacheDtypes(4, 4, 4)).all_ranks()
    with pytest.raises(ValueError, match="dtypes"):
        plan_transfer(prefill, fp32, request)
    with pytest.raises(ValueError, match=r"prefill layouts\[1\]: has tp=2, rank=0"):
        plan_transfer([prefill[0], prefill[0]], prefill, request)
    mixed = (prefill[0], Layout(GQA, 2, 1, 4, 9, 2))
    with pytest.raises(ValueError, match=r"prefill layouts\[1\]: num_blocks differs"):
        plan_transfer(mixed, prefill, request)
