"""Kimi Delta Attention as Kimi-Linear defines it, sharded by head.

Caches "ssm" [slots, heads, D, D] and "conv_q" / "conv_k" / "conv_v" [slots, heads*D, W-1]
(the last W-1 projected inputs, before the conv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import causal_conv1d, causal_conv1d_update, chunk_kda, recurrent_kda
from transfer.geometry import KDASpec, Segment
from transfer.model.layers.common import Step
from transfer.model.layers.norms import rms_normalize
from transfer.model.rank_weights import RankWeights

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

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [T, hidden] -> this rank's partial output [T, hidden]."""
        T, D = x.shape[0], self.head_dim
        q, k, v = (self._conv(x @ self.proj[n].T, n, step).view(1, T, -1, D) for n in QKV)
        f = (x @ self.f_a.T) @ self.f_b.T + self.dt_bias
        g = self.neg_decay[:, None] * F.softplus(f.view(T, -1, D))
        beta = torch.sigmoid(x @ self.b_proj.T)
        o = self._delta_rule(q, k, v, g[None], beta[None], step)[0]
        gate = ((x @ self.g_a.T) @ self.g_b.T).view(T, -1, D)
        o = rms_normalize(o, self.eps) * self.o_norm * torch.sigmoid(gate)
        return o.reshape(T, -1) @ self.o_proj.T

    def _conv(self, y: torch.Tensor, name: str, step: Step) -> torch.Tensor:
        caches, cache_name = step.caches, f"conv_{name}"
        if step.prefill:
            out, final = causal_conv1d(
                y[None], self.conv[name], output_final_state=caches is not None
            )
            if caches is not None:
                caches.conv(self.index, cache_name)[step.slot].copy_(final[0])
            return out[0]
        state = caches.conv(self.index, cache_name)[step.slot : step.slot + 1]
        return causal_conv1d_update(y, state, self.conv[name])

    def _delta_rule(self, q, k, v, g, beta, step: Step) -> torch.Tensor:
        caches = step.caches
        if step.prefill:
            o, final = chunk_kda(
                q, k, v, g, beta, output_final_state=caches is not None, use_qk_l2norm=True
            )
            if caches is not None:
                caches.ssm(self.index)[step.slot].copy_(final[0])
            return o
        ssm = caches.ssm(self.index)
        o, final = recurrent_kda(
            q, k, v, g, beta,
            initial_state=ssm[step.slot : step.slot + 1].float().contiguous(),
            output_final_state=True, use_qk_l2norm=True,
        )  # fmt: skip
        ssm[step.slot].copy_(final[0])
        return o
