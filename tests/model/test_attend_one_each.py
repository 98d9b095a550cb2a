"""Kimi-Linear's MLA attends a step's decode tokens all at once (`attend_one_tile`): each
one-row sequence gets the bits `attend` gives it alone."""

from __future__ import annotations

import random

import torch

from tests.model.batching_support import BLOCK_SIZE, NUM_BLOCKS, engines, model_of
from transfer.model.batch import SequenceStep, make_batch
from transfer.model.layers.common import ATTENTION_TILE, attend, attend_one_tile, tile_ends
from transfer.model.layers.mla_attention import KimiMLA
from transfer.model.layers.varlen import sequence_keys


def attend_one_each(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    positions: list[int],
    scale: float,
) -> torch.Tensor:
    """`attend` of N sequences of one query row each, at once: q [N,H,D] at `positions`,
    keys[i] [Li,H,D] and values[i] [Li,H,Dv] (Li <= positions[i] + 1, one key head per
    query head) -> [N,H,Dv], bit for bit what `attend` gives each row alone."""
    out = q.new_empty(q.shape[0], q.shape[1], values[0].shape[-1])
    for end, rows in tile_ends(positions).items():
        k = torch.stack([_zero_padded(keys[i], end) for i in rows], dim=1)
        v = torch.stack([_zero_padded(values[i], end) for i in rows], dim=1)
        out[rows] = attend_one_tile(q[rows], k, v, [positions[i] for i in rows], scale)
    return out


def _zero_padded(x: torch.Tensor, length: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(length - x.shape[0], *x.shape[1:])])


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


def test_kimi_mla_decode_tokens_get_the_bits_of_one_attend_each(tmp_path_factory):
    model = model_of("kimi_linear", tmp_path_factory)
    e = engines(model, num_slots=6)  # caches full of random bytes: contexts to read
    mla = next(s.fn for s in model.sublayers if isinstance(s.fn, KimiMLA))
    # contexts on both sides of a tile end and of a block boundary, and a prompt token
    contexts = [5, 15, 63, 64, 100, 130]
    blocks = iter(range(NUM_BLOCKS))
    sequences = [
        SequenceStep.decode(7, slot, [next(blocks) for _ in range(c // BLOCK_SIZE + 1)], c)
        for slot, c in enumerate(contexts)
    ]
    sequences.append(SequenceStep((1, 2, 3), 5, (next(blocks),), 0, prefill=True))
    batch = make_batch(sequences, e.caches)
    x = torch.randn(batch.token_ids.shape[0], model.geometry.hidden_size)
    together = mla(x, batch)

    def one_by_one(q, batch, cache, members):
        assert len(members) == len(contexts)  # the prompt attends on its own
        rows = []
        for j, i in enumerate(members):
            k, v = mla._keys_values(sequence_keys(batch, i, cache, None))
            rows.append(attend(q[j : j + 1], k, v, batch.positions[batch.span(i)], mla.scale))
        return torch.cat(rows)

    mla._attend_decoding = one_by_one
    assert torch.equal(together, mla(x, batch))
