"""Gated DeltaNet of Qwen3-Next and Qwen3.5, sharded by head; caches "ssm" and "conv".

in-proj (column-parallel) -> depthwise causal conv + SiLU over the rank's [q | k | v] ->
gated delta rule (l2-normalised q, k) -> gated RMSNorm (z) -> out_proj (row-parallel; the
caller all-reduces). The conv channels are the rank's q heads, then k heads, then v heads,
exactly the geometry's conv segments on that rank, so the packer re-slices them per segment.

Checkpoint layouts:
- Qwen3-Next: `in_proj_qkvz` rows grouped per key head as [q(dk) k(dk) v(r·dv) z(r·dv)] with
  r = nv / nk, and `in_proj_ba` grouped per key head as [b(r) a(r)].
- Qwen3.5: flat `in_proj_qkv` ([q all | k all | v all]), `in_proj_z`, `in_proj_b`, `in_proj_a`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import causal_conv1d, causal_conv1d_update, chunk_gdn, recurrent_gdn
from transfer.geometry import LayerSpec, Segment
from transfer.model.layers.common import Step
from transfer.model.layers.norms import gated_rms_norm
from transfer.model.rank_weights import RankWeights


class GatedDeltaNet:
    def __init__(
        self,
        layer: LayerSpec,
        w: RankWeights,
        prefix: str,
        hidden: int,
        *,
        grouped: bool,
        eps: float,
    ) -> None:
        s = layer.spec
        self.index = layer.index
        self.eps = eps
        self.k_dim, self.v_dim = s.head_k_dim, s.head_v_dim
        conv = next(t for t in layer.cache_tensors() if t.name == "conv")
        q_seg, _, v_seg = conv.segments
        heads = Segment("v_heads", s.num_v_heads, 1)
        qk_dim, v_dim = s.num_k_heads * s.head_k_dim, s.num_v_heads * s.head_v_dim
        channels = 2 * qk_dim + v_dim
        if grouped:
            self._load_grouped(layer, w, prefix, hidden)
        else:
            self.in_qkv = w.rows(prefix + "in_proj_qkv.weight", conv.segments, (channels, hidden))
            self.in_z = w.rows(prefix + "in_proj_z.weight", (v_seg,), (v_dim, hidden))
            self.in_b = w.rows(prefix + "in_proj_b.weight", (heads,), (s.num_v_heads, hidden))
            self.in_a = w.rows(prefix + "in_proj_a.weight", (heads,), (s.num_v_heads, hidden))
        width = s.conv_kernel
        self.conv_weight = w.rows(prefix + "conv1d.weight", conv.segments, (channels, 1, width))
        self.conv_weight = self.conv_weight[:, 0, :].contiguous()
        self.a_log = w.rows(prefix + "A_log", (heads,), (s.num_v_heads,))
        self.dt_bias = w.rows(prefix + "dt_bias", (heads,), (s.num_v_heads,))
        self.norm = w.full(prefix + "norm.weight", (s.head_v_dim,))
        self.out_proj = w.cols(prefix + "out_proj.weight", (v_seg,), (hidden, v_dim))
        rank_qk = q_seg.units_per_rank(w.tp) * s.head_k_dim
        self.splits = [rank_qk, rank_qk, v_seg.units_per_rank(w.tp) * s.head_v_dim]

    def _load_grouped(self, layer: LayerSpec, w: RankWeights, prefix: str, hidden: int) -> None:
        s = layer.spec
        r = s.num_v_heads // s.num_k_heads
        dk, dv = s.head_k_dim, s.head_v_dim
        group = 2 * dk + 2 * r * dv
        # A rank's key heads carry their r value heads along: one run of whole groups.
        qkvz = w.rows(
            prefix + "in_proj_qkvz.weight",
            (Segment("key_head_groups", s.num_k_heads, group),),
            (s.num_k_heads * group, hidden),
        )
        q, k, v, z = qkvz.view(-1, group, hidden).split([dk, dk, r * dv, r * dv], dim=1)
        self.in_qkv = torch.cat([t.reshape(-1, hidden) for t in (q, k, v)])
        self.in_z = z.reshape(-1, hidden)
        ba = w.rows(
            prefix + "in_proj_ba.weight",
            (Segment("key_head_groups", s.num_k_heads, 2 * r),),
            (s.num_v_heads * 2, hidden),
        )
        b, a = ba.view(-1, 2 * r, hidden).split([r, r], dim=1)
        self.in_b, self.in_a = b.reshape(-1, hidden), a.reshape(-1, hidden)

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [T, hidden] -> partial output [T, hidden]; writes the slot's S and conv."""
        T = x.shape[0]
        qkv = x @ self.in_qkv.T
        caches, slot = step.caches, step.slot
        if step.prefill:
            mixed, conv_final = causal_conv1d(
                qkv[None], self.conv_weight, output_final_state=caches is not None
            )
            mixed = mixed[0]
        else:
            window = caches.conv(self.index, "conv")[slot : slot + 1]
            mixed = causal_conv1d_update(qkv, window, self.conv_weight)
        q, k, v = mixed.split(self.splits, dim=-1)
        q = q.reshape(1, T, -1, self.k_dim).contiguous()
        k = k.reshape(1, T, -1, self.k_dim).contiguous()
        v = v.reshape(1, T, -1, self.v_dim).contiguous()
        beta = torch.sigmoid(x @ self.in_b.T)[None]
        g = (-self.a_log.exp() * F.softplus(x @ self.in_a.T + self.dt_bias))[None]
        if step.prefill:
            o, state = chunk_gdn(
                q, k, v, g, beta, output_final_state=caches is not None, use_qk_l2norm=True
            )
            if caches is not None:
                caches.ssm(self.index)[slot].copy_(state[0])
                caches.conv(self.index, "conv")[slot].copy_(conv_final[0])
        else:
            ssm = caches.ssm(self.index)
            o, state = recurrent_gdn(
                q, k, v, g, beta,
                initial_state=ssm[slot : slot + 1].float().contiguous(),
                output_final_state=True, use_qk_l2norm=True,
            )  # fmt: skip
            ssm[slot].copy_(state[0])
        z = (x @ self.in_z.T).view(T, -1, self.v_dim)
        o = gated_rms_norm(o[0], z, self.norm, self.eps)
        return o.reshape(T, -1) @ self.out_proj.T
