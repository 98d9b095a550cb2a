"""The DeepSeek-V3-style router that Kimi-Linear and Nemotron-H MoE blocks share: sigmoid
scores, a score-correction bias that only chooses experts, group-limited top-k, optional
renormalisation and routed_scaling_factor. The router is replicated on every TP rank, so
each rank picks the same experts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from transfer.errors import InvalidInput
from transfer.model.hf_config import field
from transfer.model.rank_weights import RankWeights
from transfer.model.row_invariant import linear, sigmoid


@dataclass(frozen=True)
class Routing:
    num_experts: int
    top_k: int
    num_groups: int
    topk_groups: int
    renormalize: bool
    scaling: float

    def __post_init__(self) -> None:
        if self.num_experts % self.num_groups:
            raise InvalidInput(
                f"config: field 'n_group' ({self.num_groups}) must divide the "
                f"{self.num_experts} experts"
            )
        if not 1 <= self.topk_groups <= self.num_groups:
            raise InvalidInput(
                f"config: field 'topk_group' must be in 1..{self.num_groups}, "
                f"got {self.topk_groups}"
            )
        per_group = self.num_experts // self.num_groups
        if not 1 <= self.top_k <= self.topk_groups * per_group or per_group < 2:
            raise InvalidInput(
                f"config: field 'num_experts_per_tok' ({self.top_k}) must be at least 1 and at "
                f"most the {self.topk_groups * per_group} experts of the chosen groups, "
                "with at least 2 experts per group"
            )


def routing_from_config(config: dict) -> Routing:
    """The routing fields, under transformers' or the hub's names (Kimi-Linear, Nemotron-H)."""
    return Routing(
        num_experts=field(config, "num_experts", "num_local_experts", "n_routed_experts", kind=int),
        top_k=field(config, "num_experts_per_token", "num_experts_per_tok", kind=int),
        num_groups=field(config, "num_expert_group", "n_group", default=1, kind=int),
        topk_groups=field(config, "topk_group", default=1, kind=int),
        renormalize=field(config, "moe_renormalize", "norm_topk_prob", default=True, kind=bool),
        scaling=float(field(config, "routed_scaling_factor", default=1.0, kind=(int, float))),
    )


class SigmoidRouter:
    """Reads `{prefix}weight` [experts, hidden] and `{prefix}e_score_correction_bias`."""

    def __init__(self, w: RankWeights, prefix: str, hidden: int, routing: Routing) -> None:
        n, self.routing = routing.num_experts, routing
        self.weight = w.full(prefix + "weight", (n, hidden))
        self.bias = w.full(prefix + "e_score_correction_bias", (n,))

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, top_k], expert ids [T, top_k]).

        A group scores the sum of its two best biased scores; the best `topk_groups` groups
        stay; the top_k biased scores among their experts choose; the plain scores weigh."""
        r = self.routing
        scores = sigmoid(linear(x, self.weight))
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


def expert_sum(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum over slots of weights[t, s] * expert(ids[t, s], x[t]): [T, hidden], experts taken
    in ascending id order (as transformers does)."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        out.index_add_(0, tokens, expert(e, x[tokens]) * weights[tokens, slots, None])
    return out
