"""The benchmark's pure-data setup: layer scaling, fragmented requests, the modes."""

from __future__ import annotations

import random

import pytest

from transfer.bench.transfer_setup import (
    build_instances,
    fit_geometry,
    fragmented_request,
    make_request,
    plan_all,
)
from transfer.cache.extents import count_runs
from transfer.presets import get_preset


@pytest.mark.parametrize(
    "model, p, d",
    [("qwen3-next-80b-a3b", 1, 1), ("qwen3-next-80b-a3b", 2, 2), ("kimi-linear-48b-a3b", 1, 1)],
)
def test_naive_matches_the_packers_count_at_equal_tp(model, p, d):
    instances = build_instances(get_preset(model), p, d, 16, 4096)
    transfers = plan_all(instances, make_request(instances, 4096, seed=3))
    assert transfers.count("naive") == sum(plan.naive_descriptors for plan in transfers.ours)
    assert transfers.nbytes("naive") == transfers.nbytes("raw") == transfers.bytes


@pytest.mark.parametrize(
    "model, p, d",
    [("tiny-qwen3-next", 2, 1), ("tiny-qwen3-next", 1, 2), ("tiny-kimi-linear", 2, 1)],
)
def test_modes_move_the_same_bytes_under_hetero_tp(model, p, d):
    instances = build_instances(get_preset(model), p, d, 16, 1000)
    transfers = plan_all(instances, make_request(instances, 1000, seed=5))
    assert transfers.nbytes("naive") == transfers.nbytes("raw") == transfers.bytes
    # Every naive descriptor stays inside one (layer, block, region, source): at least the
    # packer's count, and never coalesced across blocks.
    assert transfers.count("naive") >= sum(plan.naive_descriptors for plan in transfers.ours)
    for rank, layout in zip(transfers.naive, instances.naive_decode, strict=True):
        per_tensor: dict = {}
        for u in layout.kv_units():
            per_tensor[u.layer, u.tensor] = (
                per_tensor.get((u.layer, u.tensor), 0) + u.nbytes * layout.block_size
            )
        for u in layout.state_units():
            per_tensor[u.layer, u.tensor] = per_tensor.get((u.layer, u.tensor), 0) + u.nbytes
        for _, _, dst, lengths in rank:
            assert lengths.max() <= max(per_tensor.values())
            assert len(set(dst.tolist())) == len(dst)


@pytest.mark.parametrize("policy", ["contiguous", "lowest"])
def test_fragmented_request_is_fragmented_and_fits(policy):
    layout = build_instances(get_preset("qwen3-next-80b-a3b"), 1, 1, 16, 65536).prefill[0]
    blocks, slots = fragmented_request(layout, 65536, random.Random(0), policy=policy)
    assert len(blocks) == 4096 == len(set(blocks)) and len(slots) == 1
    # Holes left by earlier requests, not one contiguous run: the request needs nearly
    # every free block, so no allocator can avoid them.
    assert count_runs(blocks) > 100


@pytest.mark.parametrize(
    "model, p, d",
    [("qwen3-next-80b-a3b", 1, 1), ("qwen3-next-80b-a3b", 2, 2), ("kimi-linear-48b-a3b", 1, 1)],
)
def test_both_pools_replay_one_history_and_the_contiguous_one_posts_fewer(model, p, d):
    instances = build_instances(get_preset(model), p, d, 16, 16384)
    ours = make_request(instances, 4096, seed=7)
    old = make_request(instances, 4096, seed=7, policy="lowest")
    # Fill-then-free histories allocate alike; only the measured request differs.
    assert sorted(ours.src_slots) == sorted(old.src_slots)
    assert count_runs(ours.src_blocks) < count_runs(old.src_blocks)
    transfers = plan_all(instances, ours, old)
    assert transfers.nbytes("lowest") == transfers.bytes
    assert 100 * transfers.count("ours") <= transfers.count("naive")  # the goal
    assert transfers.count("ours") < transfers.count("lowest")


def test_fit_geometry_scales_layers_down_to_the_cap():
    geometry = get_preset("qwen3-next-80b-a3b")
    pairs = [(1, 1), (2, 1)]
    full = max(build_instances(geometry, p, d, 16, 65536).total_bytes for p, d in pairs)
    assert fit_geometry(geometry, pairs, 16, 65536, full) is geometry
    scaled = fit_geometry(geometry, pairs, 16, 65536, full // 2)
    assert 0 < len(scaled.layers) < len(geometry.layers)
    assert scaled.attention_layers and scaled.linear_layers
    assert max(build_instances(scaled, p, d, 16, 65536).total_bytes for p, d in pairs) <= full // 2
    bigger = geometry.with_num_layers(len(scaled.layers) + 1)
    assert max(build_instances(bigger, p, d, 16, 65536).total_bytes for p, d in pairs) > full // 2
    with pytest.raises(ValueError, match="--max-arena-bytes"):
        fit_geometry(geometry, pairs, 16, 65536, 1000)
