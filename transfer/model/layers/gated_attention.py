"""Qwen3-Next / Qwen3.5 full attention over the paged KV cache ("k", "v").

`q_proj` yields [query | gate] per head; q and k get per-head RMSNorm x̂·(1+w), then partial
RoPE; the output is attn·sigmoid(gate). Query heads split over the ranks; KV heads too, or
are replicated when there are fewer KV heads than ranks (`Segment.units_on_rank`).
"""

from __future__ import annotations

import torch

from transfer.geometry import LayerSpec, Segment
from transfer.model.batch import Batch
from transfer.model.layers.norms import offset_rms_norm
from transfer.model.layers.rope import PartialRope
from transfer.model.layers.varlen import paged_attention
from transfer.model.rank_weights import RankWeights
from transfer.model.row_invariant import linear, sigmoid


class GatedAttention:
    def __init__(
        self,
        layer: LayerSpec,
        w: RankWeights,
        prefix: str,
        hidden: int,
        *,
        rope: PartialRope,
        eps: float,
        bias: bool = False,
    ) -> None:
        s = layer.spec
        self.index = layer.index
        self.head_dim, self.eps, self.rope = s.head_dim, eps, rope
        (kv_seg,) = next(t for t in layer.cache_tensors() if t.name == "k").segments
        q_gate = (Segment("q_heads", s.num_q_heads, 2 * s.head_dim),)
        q_heads = (Segment("q_heads", s.num_q_heads, s.head_dim),)
        q_rows, kv_rows = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim
        qg = w.rows(prefix + "q_proj.weight", q_gate, (2 * q_rows, hidden))
        qg = qg.view(-1, 2, s.head_dim, hidden)
        self.q_proj = qg[:, 0].reshape(-1, hidden)
        self.gate_proj = qg[:, 1].reshape(-1, hidden)
        self.k_proj = w.rows(prefix + "k_proj.weight", (kv_seg,), (kv_rows, hidden))
        self.v_proj = w.rows(prefix + "v_proj.weight", (kv_seg,), (kv_rows, hidden))
        self.o_proj = w.cols(prefix + "o_proj.weight", q_heads, (hidden, q_rows))
        self.q_norm = w.full(prefix + "q_norm.weight", (s.head_dim,))
        self.k_norm = w.full(prefix + "k_norm.weight", (s.head_dim,))
        self.biases = None
        if bias:
            qg_bias = w.rows(prefix + "q_proj.bias", q_gate, (2 * q_rows,)).view(-1, 2, s.head_dim)
            o_bias = w.full(prefix + "o_proj.bias", (hidden,))
            self.biases = (
                qg_bias[:, 0].reshape(-1),
                qg_bias[:, 1].reshape(-1),
                w.rows(prefix + "k_proj.bias", (kv_seg,), (kv_rows,)),
                w.rows(prefix + "v_proj.bias", (kv_seg,), (kv_rows,)),
                o_bias if w.rank == 0 else torch.zeros_like(o_bias),  # added once by the sum
            )

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """x [T, hidden] -> partial output [T, hidden]; writes the T tokens' K/V, then each
        sequence attends causally over its context and new tokens."""
        T, D = x.shape[0], self.head_dim
        q, gate, k, v = (
            linear(x, p) for p in (self.q_proj, self.gate_proj, self.k_proj, self.v_proj)
        )
        if self.biases is not None:
            q, gate, k, v = (t + b for t, b in zip((q, gate, k, v), self.biases, strict=False))
        q = self.rope(offset_rms_norm(q.view(T, -1, D), self.q_norm, self.eps), batch.positions)
        k = self.rope(offset_rms_norm(k.view(T, -1, D), self.k_norm, self.eps), batch.positions)
        v = v.view(T, -1, D)
        o = paged_attention(batch, self.index, q, k, v, D**-0.5)
        out = linear(o.reshape(T, -1) * sigmoid(gate), self.o_proj)
        return out if self.biases is None else out + self.biases[4]
