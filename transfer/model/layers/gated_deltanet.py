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

from kernels import chunk_gdn, recurrent_gdn
from transfer.geometry import LayerSpec, Segment
from transfer.model.batch import Batch, Part
from transfer.model.layers.norms import gated_rms_norm
from transfer.model.layers.varlen import scan, scan_chunk_size, short_conv
from transfer.model.rank_weights import RankWeights
from transfer.model.row_invariant import linear, sigmoid, softplus


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

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """x [T, hidden] -> partial output [T, hidden]; reads and writes the slots' S and conv."""
        T, caches = x.shape[0], batch.caches
        conv = None if caches is None else caches.conv(self.index, "conv")
        mixed = short_conv(linear(x, self.in_qkv), batch, conv, self.conv_weight)
        q, k, v = mixed.split(self.splits, dim=-1)
        q, k = q.reshape(T, -1, self.k_dim), k.reshape(T, -1, self.k_dim)
        v = v.reshape(T, -1, self.v_dim)
        beta = sigmoid(linear(x, self.in_b))
        g = -self.a_log.exp() * softplus(linear(x, self.in_a) + self.dt_bias)
        ssm = None if caches is None else caches.ssm(self.index)
        o = scan(batch, ssm, (q, k, v, g, beta), _delta_rule)
        z = linear(x, self.in_z).view(T, -1, self.v_dim)
        o = gated_rms_norm(o, z, self.norm, self.eps)
        return linear(o.reshape(T, -1), self.out_proj)


def _delta_rule(part: Part, inputs, initial_state):
    q, k, v, g, beta = (t.contiguous() for t in inputs)
    args = dict(initial_state=initial_state, output_final_state=True, use_qk_l2norm=True,
                cu_seqlens=part.cu_seqlens)  # fmt: skip
    if part.chunked:
        return chunk_gdn(q, k, v, g, beta, chunk_size=scan_chunk_size(q.device), **args)
    # the entering states are the slots' own rows or a private gather: update them in place
    return recurrent_gdn(q, k, v, g, beta, state_in_place=initial_state is not None, **args)
