"""Kimi-Linear's MoE: sigmoid routing with a score-correction bias and group-limited top-k,
plus shared experts.

Under TP every expert (and the shared experts) splits its intermediate dim over the ranks;
the router is replicated, so each rank routes identically and the caller all-reduces once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transfer.geometry import Segment
from transfer.model.layers.mlp import SwiGLU
from transfer.model.rank_weights import RankWeights
from transfer.model.row_invariant import linear, sigmoid, silu


@dataclass(frozen=True)
class Routing:
    num_experts: int
    top_k: int
    num_groups: int
    topk_groups: int
    renormalize: bool
    scaling: float


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
        n, self.routing = routing.num_experts, routing
        ffn = (Segment("moe_ffn", intermediate, 1),)
        self.router = w.full(prefix + "gate.weight", (n, hidden))
        self.bias = w.full(prefix + "gate.e_score_correction_bias", (n,))
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

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, top_k], expert ids [T, top_k])."""
        r = self.routing
        scores = sigmoid(linear(x, self.router))
        choice = (scores + self.bias).view(-1, r.num_groups, r.num_experts // r.num_groups)
        group_scores = choice.topk(2, dim=-1).values.sum(-1)  # [T, groups]
        groups = group_scores.topk(r.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        ids = choice.topk(r.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if r.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * r.scaling, ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> this rank's partial output [T, hidden]."""
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            tokens, slots = (ids == expert).nonzero(as_tuple=True)
            gate, up = linear(x[tokens], self.gate_up[expert]).chunk(2, dim=-1)
            y = linear(silu(gate) * up, self.down[expert])
            out.index_add_(0, tokens, y * weights[tokens, slots, None])
        return out if self.shared is None else out + self.shared(x)
