"""Gated DeltaNet mixer (Qwen3-Next style), sharded by head; caches "ssm" and "conv" (q|k|v)."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from kernels import causal_conv1d, causal_conv1d_update, chunk_gdn, recurrent_gdn
from transfer.geometry import LayerSpec
from transfer.model.layers.common import Step, rms_norm
from transfer.model.weights import WeightSource, shard_cols, shard_rows


class GDNMixer:
    """in-proj q,k,v (column-parallel) -> short conv over the rank's [q|k|v] -> delta rule
    -> gated RMSNorm (z) -> out-proj (row-parallel; the caller all-reduces)."""

    def __init__(self, layer: LayerSpec, hidden: int, tp: int, rank: int, w: WeightSource):
        s = layer.spec
        self.index = layer.index
        conv = next(t for t in layer.cache_tensors() if t.name == "conv")
        q_seg, k_seg, v_seg = conv.segments
        heads = dataclasses.replace(v_seg, unit_elems=1)
        p = f"layers.{layer.index}.gdn."
        width = s.conv_kernel
        qkv, convs = [], []
        for name, seg in (("q", q_seg), ("k", k_seg), ("v", v_seg)):
            channels = seg.num_units * seg.unit_elems
            qkv.append(shard_rows(w.linear(p + f"{name}_proj", channels, hidden), seg, tp, rank))
            conv_w = w.normal(p + f"conv_{name}", (channels, width), width**-0.5)
            convs.append(shard_rows(conv_w, seg, tp, rank))
        self.qkv_proj = w.place(torch.cat(qkv))
        self.conv_weight = w.place(torch.cat(convs))
        z_proj = w.linear(p + "z_proj", s.num_v_heads * s.head_v_dim, hidden)
        self.z_proj = w.place(shard_rows(z_proj, v_seg, tp, rank))
        a_proj, b_proj = (w.linear(p + f"{x}_proj", s.num_v_heads, hidden) for x in "ab")
        self.a_proj = w.place(shard_rows(a_proj, heads, tp, rank))
        self.b_proj = w.place(shard_rows(b_proj, heads, tp, rank))
        a_log = w.uniform(p + "A_log", (s.num_v_heads,), 0.0, math.log(16.0))
        self.a_log = w.place(shard_rows(a_log, heads, tp, rank))
        dt_bias = w.normal(p + "dt_bias", (s.num_v_heads,), 0.5)
        self.dt_bias = w.place(shard_rows(dt_bias, heads, tp, rank))
        self.norm = w.place(w.normal(p + "norm", (s.head_v_dim,), 0.1, mean=1.0))
        out = w.linear(p + "out_proj", hidden, s.num_v_heads * s.head_v_dim)
        self.out_proj = w.place(shard_cols(out, v_seg, tp, rank))
        qk_channels = q_seg.units_per_rank(tp) * s.head_k_dim
        self.splits = [qk_channels, qk_channels, v_seg.units_per_rank(tp) * s.head_v_dim]
        self.k_dim, self.v_dim = s.head_k_dim, s.head_v_dim

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [T, hidden] -> partial output [T, hidden]."""
        T = x.shape[0]
        qkv = x @ self.qkv_proj.T
        caches, slot = step.caches, step.slot
        if step.prefill:
            mixed, conv_final = causal_conv1d(
                qkv[None], self.conv_weight, output_final_state=caches is not None
            )
            mixed = mixed[0]
        else:
            state = caches.conv(self.index, "conv")[slot : slot + 1]
            mixed = causal_conv1d_update(qkv, state, self.conv_weight)
        q, k, v = mixed.split(self.splits, dim=-1)
        q = q.reshape(1, T, -1, self.k_dim).contiguous()
        k = k.reshape(1, T, -1, self.k_dim).contiguous()
        v = v.reshape(1, T, -1, self.v_dim).contiguous()
        g = -self.a_log.exp() * F.softplus(x @ self.a_proj.T + self.dt_bias)
        beta = torch.sigmoid(x @ self.b_proj.T)
        if step.prefill:
            o, state = chunk_gdn(
                q, k, v, g[None], beta[None],
                output_final_state=caches is not None, use_qk_l2norm=True,
            )  # fmt: skip
            if caches is not None:
                caches.ssm(self.index)[slot].copy_(state[0])
                caches.conv(self.index, "conv")[slot].copy_(conv_final[0])
        else:
            ssm = caches.ssm(self.index)
            o, state = recurrent_gdn(
                q, k, v, g[None], beta[None],
                initial_state=ssm[slot : slot + 1].float().contiguous(),
                output_final_state=True, use_qk_l2norm=True,
            )  # fmt: skip
            ssm[slot].copy_(state[0])
        z = (x @ self.z_proj.T).view(T, -1, self.v_dim)
        o = rms_norm(o[0], self.norm) * F.silu(z)
        return o.reshape(T, -1) @ self.out_proj.T
