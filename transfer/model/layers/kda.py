"""Kimi Delta Attention mixer, sharded by head; caches "ssm", "conv_q", "conv_k", "conv_v"."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from kernels import causal_conv1d, causal_conv1d_update, chunk_kda, recurrent_kda
from transfer.geometry import LayerSpec
from transfer.model.layers.common import Step, rms_norm
from transfer.model.weights import WeightSource, shard_cols, shard_rows

CONVS = ("conv_q", "conv_k", "conv_v")


class KDAMixer:
    """q,k,v (column-parallel), each through its own short conv -> per-channel-decay delta
    rule -> RMSNorm gated by sigmoid(low-rank gate) -> out-proj (row-parallel)."""

    def __init__(self, layer: LayerSpec, hidden: int, tp: int, rank: int, w: WeightSource):
        s = layer.spec
        self.index = layer.index
        self.head_dim = s.head_dim
        (seg,) = next(t for t in layer.cache_tensors() if t.name == "conv_q").segments
        heads = dataclasses.replace(seg, unit_elems=1)
        channels = s.num_heads * s.head_dim
        p = f"layers.{layer.index}.kda."
        self.proj = {}
        self.conv = {}
        for name in ("q", "k", "v"):
            proj = w.linear(p + f"{name}_proj", channels, hidden)
            self.proj[name] = w.place(shard_rows(proj, seg, tp, rank))
            conv = w.normal(p + f"conv_{name}", (channels, s.conv_kernel), s.conv_kernel**-0.5)
            self.conv[name] = w.place(shard_rows(conv, seg, tp, rank))
        # Low-rank (rank head_dim) decay and gate projections: the down half is replicated.
        self.f_a = w.place(w.linear(p + "f_a_proj", s.head_dim, hidden))
        self.f_b = w.place(
            shard_rows(w.linear(p + "f_b_proj", channels, s.head_dim), seg, tp, rank)
        )
        self.g_a = w.place(w.linear(p + "g_a_proj", s.head_dim, hidden))
        self.g_b = w.place(
            shard_rows(w.linear(p + "g_b_proj", channels, s.head_dim), seg, tp, rank)
        )
        self.b_proj = w.place(
            shard_rows(w.linear(p + "b_proj", s.num_heads, hidden), heads, tp, rank)
        )
        a_log = w.uniform(p + "A_log", (s.num_heads,), 0.0, math.log(16.0))
        self.a_log = w.place(shard_rows(a_log, heads, tp, rank))
        self.dt_bias = w.place(shard_rows(w.normal(p + "dt_bias", (channels,), 0.5), seg, tp, rank))
        self.norm = w.place(w.normal(p + "norm", (s.head_dim,), 0.1, mean=1.0))
        self.out_proj = w.place(shard_cols(w.linear(p + "o_proj", hidden, channels), seg, tp, rank))

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [T, hidden] -> partial output [T, hidden]."""
        T, D = x.shape[0], self.head_dim
        caches, slot = step.caches, step.slot
        qkv = []
        for name in ("q", "k", "v"):
            y = x @ self.proj[name].T
            if step.prefill:
                y, final = causal_conv1d(
                    y[None], self.conv[name], output_final_state=caches is not None
                )
                y = y[0]
                if caches is not None:
                    caches.conv(self.index, f"conv_{name}")[slot].copy_(final[0])
            else:
                state = caches.conv(self.index, f"conv_{name}")[slot : slot + 1]
                y = causal_conv1d_update(y, state, self.conv[name])
            qkv.append(y.view(1, T, -1, D))
        q, k, v = qkv
        f = (x @ self.f_a.T) @ self.f_b.T + self.dt_bias
        g = -self.a_log.exp()[:, None] * F.softplus(f.view(T, -1, D))
        beta = torch.sigmoid(x @ self.b_proj.T)
        if step.prefill:
            o, state = chunk_kda(
                q, k, v, g[None], beta[None],
                output_final_state=caches is not None, use_qk_l2norm=True,
            )  # fmt: skip
            if caches is not None:
                caches.ssm(self.index)[slot].copy_(state[0])
        else:
            ssm = caches.ssm(self.index)
            o, state = recurrent_kda(
                q, k, v, g[None], beta[None],
                initial_state=ssm[slot : slot + 1].float().contiguous(),
                output_final_state=True, use_qk_l2norm=True,
            )  # fmt: skip
            ssm[slot].copy_(state[0])
        gate = ((x @ self.g_a.T) @ self.g_b.T).view(T, -1, D)
        o = rms_norm(o[0], self.norm) * torch.sigmoid(gate)
        return o.reshape(T, -1) @ self.out_proj.T
