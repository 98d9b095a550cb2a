"""`attend_one_each` (Kimi-Linear's MLA decode tokens, all at once) gives each one-row
sequence the bits `attend` gives it alone."""

from __future__ import annotations

import random

import torch

from transfer.model.layers.common import ATTENTION_TILE, attend, attend_one_each


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
