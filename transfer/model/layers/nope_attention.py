"""Nemotron-H's attention: GQA without RoPE over the paged "k"/"v" caches, sharded by head
(KV heads replicated on several ranks when there are fewer of them than ranks)."""

from __future__ import annotations

import torch

from transfer.geometry import GQASpec, Segment, Sharding
from transfer.model.batch import Batch
from transfer.model.layers.varlen import paged_attention
from transfer.model.rank_weights import RankWeights
from transfer.model.row_invariant import linear


class NoPEAttention:
    def __init__(self, index: int, spec: GQASpec, prefix: str, w: RankWeights, hidden: int):
        self.index, D = index, spec.head_dim
        self.head_dim = D
        q_dim, kv_dim = spec.num_q_heads * D, spec.num_kv_heads * D
        q_heads = (Segment("q_heads", spec.num_q_heads, D),)
        kv_heads = (Segment("kv_heads", spec.num_kv_heads, D, Sharding.SPLIT_OR_REPLICATE),)
        self.q = w.rows(prefix + "q_proj.weight", q_heads, (q_dim, hidden))
        self.k = w.rows(prefix + "k_proj.weight", kv_heads, (kv_dim, hidden))
        self.v = w.rows(prefix + "v_proj.weight", kv_heads, (kv_dim, hidden))
        self.o = w.cols(prefix + "o_proj.weight", q_heads, (hidden, q_dim))
        self.scale = spec.head_dim**-0.5

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """x [T, hidden] -> this rank's partial output [T, hidden]; writes the T tokens' K, V,
        then each sequence attends causally over its context and new tokens."""
        T, D = x.shape[0], self.head_dim
        q = linear(x, self.q).view(T, -1, D)
        k, v = linear(x, self.k).view(T, -1, D), linear(x, self.v).view(T, -1, D)
        o = paged_attention(batch, self.index, q, k, v, self.scale)
        return linear(o.reshape(T, -1), self.o)
