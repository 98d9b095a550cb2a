"""Nemotron-H's MoE block (transformers' NemotronHMoE): routed relu² experts chosen by the
shared sigmoid router (transfer/model/layers/sigmoid_router.py), plus a relu² shared expert
that sees the same input.

Under TP every routed expert and the shared expert split their intermediate dim over the
ranks (up by rows, down by columns, like the dense MLP); the router is replicated, so each
rank picks the same experts and returns a partial sum that the caller all-reduces once.
"""

from __future__ import annotations

import torch

from transfer.geometry import Segment
from transfer.model.layers.relu2_mlp import Relu2MLP
from transfer.model.layers.sigmoid_router import Routing, SigmoidRouter, expert_sum
from transfer.model.rank_weights import RankWeights
from transfer.model.row_invariant import linear


class Relu2MoE:
    """Expert e is down_e(relu(up_e x)^2), weights under `{prefix}experts.{e}.` (the hub's
    and save_pretrained's names); router under `{prefix}gate.`; shared under
    `{prefix}shared_experts.`."""

    def __init__(
        self,
        w: RankWeights,
        prefix: str,
        hidden: int,
        routing: Routing,
        intermediate: int,
        shared_intermediate: int,
    ) -> None:
        ffn = (Segment("moe_ffn", intermediate, 1),)
        self.route = SigmoidRouter(w, prefix + "gate.", hidden, routing)
        up, down = [], []
        for e in range(routing.num_experts):
            p = f"{prefix}experts.{e}."
            up.append(w.rows(p + "up_proj.weight", ffn, (intermediate, hidden)))
            down.append(w.cols(p + "down_proj.weight", ffn, (hidden, intermediate)))
        self.up, self.down = torch.stack(up), torch.stack(down)  # [E, i, H], [E, H, i]
        self.shared = Relu2MLP(w, prefix + "shared_experts.", hidden, shared_intermediate)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return linear(torch.relu(linear(x, self.up[e])).square(), self.down[e])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> this rank's partial output [T, hidden]."""
        weights, ids = self.route(x)
        return expert_sum(x, weights, ids, self._expert) + self.shared(x)
