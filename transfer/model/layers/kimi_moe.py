"""Kimi-Linear's MoE: sigmoid routing with a score-correction bias and group-limited top-k,
plus shared experts.

Under TP every expert (and the shared experts) splits its intermediate dim over the ranks;
the router is replicated, so each rank routes identically and the caller all-reduces once.
"""

from __future__ import annotations

import torch

from transfer.geometry import Segment
from transfer.model.layers.mlp import SwiGLU
from transfer.model.layers.sigmoid_router import Routing, SigmoidRouter, expert_sum
from transfer.model.rank_weights import RankWeights
from transfer.model.row_invariant import linear, silu

__all__ = ["KimiMoE", "Routing"]


class KimiMoE:
    """Expert e is down(silu(w1 x) * w3 x) with down = w2 (the hub's names). The bias only
    chooses experts; the weights are the plain sigmoid scores, optionally renormalised, times
    routed_scaling_factor."""

    def __init__(
        self,
        w: RankWeights,
        prefix: str,
        hidden: int,
        routing: Routing,
        intermediate: int,
        num_shared: int,
    ):
        n = routing.num_experts
        ffn = (Segment("moe_ffn", intermediate, 1),)
        self.route = SigmoidRouter(w, prefix + "gate.", hidden, routing)
        up_shape, down_shape = (intermediate, hidden), (hidden, intermediate)
        gate_up, down = [], []
        for e in range(n):
            p = f"{prefix}experts.{e}."
            gate = w.rows(p + "w1.weight", ffn, up_shape)
            gate_up.append(torch.cat([gate, w.rows(p + "w3.weight", ffn, up_shape)]))
            down.append(w.cols(p + "w2.weight", ffn, down_shape))
        self.gate_up, self.down = torch.stack(gate_up), torch.stack(down)  # [E, 2i, H], [E, H, i]
        shared = intermediate * num_shared
        self.shared = SwiGLU(w, prefix + "shared_experts.", hidden, shared) if shared else None

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up[e]).chunk(2, dim=-1)
        return linear(silu(gate) * up, self.down[e])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> this rank's partial output [T, hidden]."""
        weights, ids = self.route(x)
        out = expert_sum(x, weights, ids, self._expert)
        return out if self.shared is None else out + self.shared(x)
