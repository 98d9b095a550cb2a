"""Nemotron-H's MLP block: down(relu(up(x))^2); up column-parallel, down row-parallel."""

from __future__ import annotations

import torch

from transfer.geometry import Segment
from transfer.model.rank_weights import RankWeights
from transfer.model.row_invariant import linear


class Relu2MLP:
    def __init__(self, w: RankWeights, prefix: str, hidden: int, intermediate: int):
        ffn = (Segment("ffn", intermediate, 1),)
        self.up = w.rows(prefix + "up_proj.weight", ffn, (intermediate, hidden))
        self.down = w.cols(prefix + "down_proj.weight", ffn, (hidden, intermediate))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> this rank's partial output [T, hidden]."""
        return linear(torch.relu(linear(x, self.up)).square(), self.down)
