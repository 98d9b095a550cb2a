"""SwiGLU MLP, sharded on its intermediate dimension (gate/up by rows, down by columns)."""

from __future__ import annotations

import torch

from transfer.geometry import Segment
from transfer.model.rank_weights import RankWeights
from transfer.model.row_invariant import linear, silu


class SwiGLU:
    """down(silu(gate(x)) * up(x)); the rank's partial output, the caller all-reduces."""

    def __init__(self, w: RankWeights, prefix: str, hidden: int, intermediate: int) -> None:
        ffn = (Segment("ffn", intermediate, 1),)
        gate = w.rows(prefix + "gate_proj.weight", ffn, (intermediate, hidden))
        up = w.rows(prefix + "up_proj.weight", ffn, (intermediate, hidden))
        self.gate_up = torch.cat([gate, up])
        self.down = w.cols(prefix + "down_proj.weight", ffn, (hidden, intermediate))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> partial [T, hidden]."""
        gate, up = linear(x, self.gate_up).chunk(2, dim=-1)
        return linear(silu(gate) * up, self.down)
