"""`launch --verify` check (1) on its own: re-slicing by the geometry's shard functions,
written out by hand for one case, and every way a decode rank's cache can be wrong."""

from __future__ import annotations

import pytest
import torch

from transfer.presets import get_preset
from transfer.serving.launch.verify import (
    assemble_global,
    check_request,
    compare_snapshots,
    slice_for_rank,
    tokens_check,
)
from transfer.serving.ranks.snapshots import save_snapshot

MODELS = ["tiny-qwen3-next", "tiny-kimi-linear", "tiny-nemotron-h"]


def random_global(geometry, num_tokens: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in geometry.layers:
        for tensor in layer.cache_tensors():
            rows = num_tokens if tensor.role.value == "kv" else tensor.steps
            out[f"L{layer.index}.{tensor.name}"] = torch.randn(rows, tensor.channels, generator=gen)
    return out


@pytest.mark.parametrize("model", MODELS)
def test_slices_reassemble_to_the_global_cache(model):
    geometry = get_preset(model)
    full = random_global(geometry)
    for tp in geometry.valid_tps():
        shards = [slice_for_rank(geometry, full, tp, rank) for rank in range(tp)]
        rebuilt = assemble_global(geometry, shards)
        assert compare_snapshots(full, rebuilt) == []


def test_gdn_conv_is_resliced_per_segment():
    """Bug 1: q|k|v are separate head-sharded segments; rank 0 of 2 holds the first half of
    each, not the first half of the concatenation."""
    geometry = get_preset("tiny-qwen3-next")  # GDN: 4 q/k heads and 8 v heads of 32 channels
    full = random_global(geometry)
    conv = full["L0.conv"]  # [3, 128 q | 128 k | 256 v]
    rank0 = slice_for_rank(geometry, full, 2, 0)["L0.conv"]
    by_hand = torch.cat([conv[:, 0:64], conv[:, 128:192], conv[:, 256:384]], dim=1)
    assert torch.equal(rank0, by_hand)
    naive = conv[:, :256]  # one head-sharded tensor: scrambles channels
    assert compare_snapshots({"L0.conv": by_hand}, {"L0.conv": naive}) != []


def test_replicated_units_must_agree_across_prefill_ranks():
    geometry = get_preset("tiny-kimi-linear")  # MLA latent: replicated on every rank
    full = random_global(geometry)
    shards = [slice_for_rank(geometry, full, 2, rank) for rank in range(2)]
    shards[1]["L3.kv"][2, 7] += 1.0
    with pytest.raises(ValueError, match="prefill ranks 0 and 1 disagree"):
        assemble_global(geometry, shards)


def test_gqa_heads_replicated_when_fewer_than_ranks():
    """Bug 2: 2 KV heads at TP 4: ranks 0 and 1 both hold head 0, ranks 2 and 3 head 1."""
    geometry = get_preset("tiny-qwen3-next")
    full = random_global(geometry)
    k = full["L3.k"]  # [tokens, 2 heads * 64]
    for rank, head in ((0, 0), (1, 0), (2, 1), (3, 1)):
        got = slice_for_rank(geometry, full, 4, rank)["L3.k"]
        assert torch.equal(got, k[:, head * 64 : (head + 1) * 64])


def test_request_check_finds_a_flipped_byte_a_missing_rank_and_a_wrong_dtype(tmp_path):
    geometry = get_preset("tiny-kimi-linear")
    full = random_global(geometry)
    for rank in range(2):
        save_snapshot(tmp_path, "r/1", "prefill", rank, slice_for_rank(geometry, full, 2, rank))
    decode = slice_for_rank(geometry, full, 1, 0)
    save_snapshot(tmp_path, "r/1", "decode", 0, decode)
    assert check_request(geometry, tmp_path, "r/1", 2, 1).ok

    flipped = {k: v.clone() for k, v in decode.items()}
    flipped["L0.conv_k"].view(torch.uint8)[1, 5] ^= 1
    save_snapshot(tmp_path, "r/1", "decode", 0, flipped)
    problems = check_request(geometry, tmp_path, "r/1", 2, 1).problems
    assert problems == ("decode rank 0: L0.conv_k: 1 bytes differ, in rows [1]",)

    halved = {**decode, "L1.ssm": decode["L1.ssm"].to(torch.bfloat16)}
    assert "L1.ssm: expected torch.float32" in compare_snapshots(decode, halved)[0]
    assert check_request(geometry, tmp_path, "r/1", 2, 2).problems == (
        "decode: 1 rank snapshots, expected 2",
    )


def test_tokens_check_names_the_first_difference():
    assert tokens_check([1, 2, 3], [1, 2, 3]) is None
    assert "at index 1" in tokens_check([1, 2, 3], [1, 9, 3])
    assert "at index 2" in tokens_check([1, 2, 3], [1, 2])
