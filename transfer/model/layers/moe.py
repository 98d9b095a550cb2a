"""Sparse MoE of Qwen3-Next / Qwen3.5-MoE: softmax top-k routing plus a sigmoid-gated shared
expert. Every rank routes the same (replicated router); experts shard on their intermediate
dimension, so each rank returns a partial sum that the caller all-reduces."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from transfer.geometry import Segment
from transfer.model.layers.mlp import SwiGLU
from transfer.model.qwen_config import MoEConfig
from transfer.model.rank_weights import RankWeights
from transfer.model.row_invariant import linear, sigmoid, silu


class SparseMoE:
    def __init__(self, w: RankWeights, prefix: str, hidden: int, cfg: MoEConfig) -> None:
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        n, inter = cfg.num_experts, cfg.intermediate_size
        ffn = Segment("moe_ffn", inter, 1)
        self.router = w.full(prefix + "gate.weight", (n, hidden))
        fused = prefix + "experts.gate_up_proj"
        if w.has(fused):  # transformers' in-memory layout: [E, 2I, H] and [E, H, I]
            self.gate_up = w.along(fused, 1, (ffn, ffn), (n, 2 * inter, hidden))
            self.down = w.along(prefix + "experts.down_proj", 2, (ffn,), (n, hidden, inter))
        else:  # the hub's (and save_pretrained's) one module per expert
            gate_up, down = [], []
            for e in range(n):
                p = f"{prefix}experts.{e}."
                gate = w.rows(p + "gate_proj.weight", (ffn,), (inter, hidden))
                up = w.rows(p + "up_proj.weight", (ffn,), (inter, hidden))
                gate_up.append(torch.cat([gate, up]))
                down.append(w.cols(p + "down_proj.weight", (ffn,), (hidden, inter)))
            self.gate_up, self.down = torch.stack(gate_up), torch.stack(down)
        self.shared = SwiGLU(w, prefix + "shared_expert.", hidden, cfg.shared_intermediate_size)
        self.shared_gate = w.full(prefix + "shared_expert_gate.weight", (1, hidden))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k], experts [T, k])."""
        probs = F.softmax(linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> partial [T, hidden]."""
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            tokens, slot = torch.where(experts == e)
            gate, up = linear(x[tokens], self.gate_up[e]).chunk(2, dim=-1)
            y = linear(silu(gate) * up, self.down[e])
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        # A row-wise sum, not a one-column GEMM: a GEMV's rows change with the row count
        # (transfer/model/row_invariant.py), a sum's do not.
        shared_gate = (x * self.shared_gate).sum(dim=-1, keepdim=True)
        return out + sigmoid(shared_gate) * self.shared(x)
