"""The batched decode attentions give the bits of what they replace: `decode_attention`
copies only the positions up to the longest context (zeros past it) yet reduces over whole
blocks as the whole-block copy did; `attend_one_each` gives each one-row sequence what
`attend` gives it alone."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from transfer.model.layers.common import ATTENTION_TILE, attend, attend_one_each
from transfer.model.layers.varlen import decode_attention


def _whole_blocks(batch, q, k_cache, v_cache, scale: float) -> torch.Tensor:
    """decode_attention as it was: every block of every sequence copied whole."""
    rows = q[batch.decode.tokens].float()
    lengths = batch.positions[batch.decode.tokens] + 1
    block_size = k_cache.shape[1]
    num_blocks = -(-int(lengths.max()) // block_size)
    n, length = rows.shape[0], num_blocks * block_size
    invalid = torch.arange(length)[None, :] >= lengths[:, None]
    table = batch.block_tables[:, :num_blocks].clamp(min=0).flatten()
    stale = invalid.flatten().nonzero().squeeze(1)
    kv_heads, dv = k_cache.shape[2], v_cache.shape[-1]
    grouped = rows.view(n, kv_heads, rows.shape[1] // kv_heads, rows.shape[2])
    out = rows.new_empty(kv_heads, n, grouped.shape[2], dv)
    for head in range(kv_heads):
        keys = k_cache[:, :, head].index_select(0, table).view(n, length, -1).float()
        values = v_cache[:, :, head].index_select(0, table).view(n * length, dv).float()
        values.index_fill_(0, stale, 0.0)
        scores = torch.bmm(grouped[:, head], keys.transpose(1, 2)) * scale
        scores.masked_fill_(invalid[:, None, :], float("-inf"))
        torch.bmm(scores.softmax(-1), values.view(n, length, dv), out=out[head])
    return out.transpose(0, 1).reshape(n, -1, dv)


def _decode_batch(rng: random.Random, block_size: int, kv_heads: int, group: int, dtype):
    n = rng.randint(1, 12)
    lengths = [rng.randint(1, rng.choice([block_size, 3 * block_size])) for _ in range(n)]
    width = max(-(-length // block_size) for length in lengths) + 1
    num_blocks = n * width
    # head-major storage seen as [NB, BS, HK, D]; NaN wherever no context lives
    k_cache = torch.full((num_blocks, kv_heads, block_size, 32), float("nan"), dtype=dtype)
    v_cache = torch.full((num_blocks, kv_heads, block_size, 16), float("nan"), dtype=dtype)
    k_cache, v_cache = k_cache.permute(0, 2, 1, 3), v_cache.permute(0, 2, 1, 3)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = torch.full((n, width), -1, dtype=torch.long)
    for i, length in enumerate(lengths):
        for b in range(-(-length // block_size)):
            tables[i, b] = free.pop()
            rows = min(block_size, length - b * block_size)
            k_cache[tables[i, b], :rows] = torch.randn(rows, kv_heads, 32).to(dtype)
            v_cache[tables[i, b], :rows] = torch.randn(rows, kv_heads, 16).to(dtype)
    tokens = torch.arange(n)
    part = SimpleNamespace(tokens=tokens, take=lambda x: x[tokens])
    batch = SimpleNamespace(
        decode=part, cu_seqlens=torch.arange(n + 1), block_tables=tables,
        positions=torch.tensor([length - 1 for length in lengths]),
    )  # fmt: skip
    return batch, torch.randn(n, kv_heads * group, 32), k_cache, v_cache


@pytest.mark.parametrize("block_size", [16, 112])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_gives_the_whole_block_bits(block_size, dtype):
    rng = random.Random(block_size)
    for _ in range(20):
        kv_heads, group = rng.choice([1, 2]), rng.choice([1, 4])
        batch, q, k_cache, v_cache = _decode_batch(rng, block_size, kv_heads, group, dtype)
        got = decode_attention(batch, q, k_cache, v_cache, 0.125)
        assert not got.isnan().any()
        assert torch.equal(got, _whole_blocks(batch, q, k_cache, v_cache, 0.125))


def test_attend_one_each_gives_each_row_what_attend_gives_it_alone():
    rng = random.Random(0)
    heads, dim, dv = 4, 48, 32
    # positions on both sides of tile ends, and a fresh one-token prompt (position 0)
    positions = [0, 5, ATTENTION_TILE - 1, ATTENTION_TILE, 2 * ATTENTION_TILE + 3]
    positions += [rng.randrange(3 * ATTENTION_TILE) for _ in range(12)]
    q = torch.randn(len(positions), heads, dim)
    keys = [torch.randn(p + 1, heads, dim) for p in positions]
    values = [torch.randn(p + 1, heads, dv) for p in positions]
    got = attend_one_each(q, keys, values, positions, 0.1)
    for i, p in enumerate(positions):
        alone = attend(q[i : i + 1], keys[i], values[i], torch.tensor([p]), 0.1)
        assert torch.equal(got[i : i + 1], alone), f"row {i} at position {p}"
