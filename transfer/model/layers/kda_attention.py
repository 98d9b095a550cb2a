"""Kimi Delta Attention as Kimi-Linear defines it, sharded by head.

Caches "ssm" [slots, heads, D, D] and "conv_q" / "conv_k" / "conv_v" [slots, heads*D, W-1]
(the last W-1 projected inputs, before the conv).
"""

from __future__ import annotations

import torch

from kernels import chunk_kda, recurrent_kda
from transfer.geometry import KDASpec, Segment
from transfer.model.batch import Batch, Part
from transfer.model.layers.norms import rms_normalize
from transfer.model.layers.varlen import scan, scan_chunk_size, short_conv
from transfer.model.rank_weights import RankWeights
from transfer.model.row_invariant import linear, sigmoid, softplus

QKV = ("q", "k", "v")


class KimiDeltaAttention:
    """q/k/v projections (column-parallel), each through its own short conv + SiLU; per-channel
    decay g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias); beta = sigmoid(b_proj(x)); the
    delta rule; RMSNorm gated by sigmoid(g_b(g_a(x))); o_proj (row-parallel, caller reduces)."""

    def __init__(
        self, index: int, spec: KDASpec, prefix: str, w: RankWeights, hidden: int, eps: float
    ):
        self.index, self.eps = index, eps
        H, D, W = spec.num_heads, spec.head_dim, spec.conv_kernel
        self.head_dim = D
        channels = (Segment("heads", H, D),)
        heads = (Segment("heads", H, 1),)
        self.proj = {x: w.rows(f"{prefix}{x}_proj.weight", channels, (H * D, hidden)) for x in QKV}
        self.conv = {
            x: w.rows(f"{prefix}{x}_conv1d.weight", channels, (H * D, 1, W))[:, 0] for x in QKV
        }
        self.f_a = w.full(prefix + "f_a_proj.weight", (D, hidden))
        self.f_b = w.rows(prefix + "f_b_proj.weight", channels, (H * D, D))
        self.dt_bias = w.rows(prefix + "dt_bias", channels, (H * D,))
        self.neg_decay = -w.along(prefix + "A_log", 2, heads, (1, 1, H, 1)).reshape(-1).exp()
        self.b_proj = w.rows(prefix + "b_proj.weight", heads, (H, hidden))
        self.g_a = w.full(prefix + "g_a_proj.weight", (D, hidden))
        self.g_b = w.rows(prefix + "g_b_proj.weight", channels, (H * D, D))
        self.o_norm = w.full(prefix + "o_norm.weight", (D,))
        self.o_proj = w.cols(prefix + "o_proj.weight", channels, (hidden, H * D))

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """x [T, hidden] -> this rank's partial output [T, hidden]; reads and writes the
        slots' S and conv windows."""
        T, D, caches = x.shape[0], self.head_dim, batch.caches
        q, k, v = (
            short_conv(
                linear(x, self.proj[n]), batch,
                None if caches is None else caches.conv(self.index, f"conv_{n}"), self.conv[n],
            ).view(T, -1, D)
            for n in QKV
        )  # fmt: skip
        f = linear(linear(x, self.f_a), self.f_b) + self.dt_bias
        g = self.neg_decay[:, None] * softplus(f.view(T, -1, D))
        beta = sigmoid(linear(x, self.b_proj))
        ssm = None if caches is None else caches.ssm(self.index)
        o = scan(batch, ssm, (q, k, v, g, beta), _delta_rule)
        gate = linear(linear(x, self.g_a), self.g_b).view(T, -1, D)
        o = rms_normalize(o, self.eps) * self.o_norm * sigmoid(gate)
        return linear(o.reshape(T, -1), self.o_proj)


def _delta_rule(part: Part, inputs, initial_state):
    args = dict(initial_state=initial_state, output_final_state=True, use_qk_l2norm=True,
                cu_seqlens=part.cu_seqlens)  # fmt: skip
    if part.chunked:
        return chunk_kda(*inputs, chunk_size=scan_chunk_size(inputs[0].device), **args)
    # the entering states are the slots' own rows or a private gather: update them in place
    return recurrent_kda(*inputs, state_in_place=initial_state is not None, **args)
