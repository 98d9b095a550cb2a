"""Nemotron-H's Mamba2 mixer, sharded by head; B and C groups split, or replicated on every
rank of a group when n_groups < TP.

Caches "ssm" [slots, heads, head_dim, state_size] fp32 and "conv" [slots, x|B|C of the rank,
W-1] (the last W-1 inputs of the conv, before it).
"""

from __future__ import annotations

import torch

from kernels import chunk_mamba2, recurrent_mamba2
from transfer.geometry import Mamba2Spec, Segment, Sharding
from transfer.model.batch import Batch, Part
from transfer.model.distributed import TPGroup
from transfer.model.layers.varlen import scan, short_conv
from transfer.model.rank_weights import RankWeights
from transfer.model.row_invariant import linear, silu, softplus


class Mamba2Mixer:
    """in_proj = z | x | B | C | dt (column-parallel) -> conv1d (with bias) + SiLU over x|B|C ->
    dt = softplus(dt + dt_bias) (clamped below at time_step_min in prefill only, as
    transformers does) -> SSD with A = -exp(A_log) and the D skip -> y * silu(z) -> RMSNorm
    grouped by n_groups -> out_proj (row-parallel, caller reduces)."""

    def __init__(
        self,
        index: int,
        spec: Mamba2Spec,
        prefix: str,
        w: RankWeights,
        tp: TPGroup,
        hidden: int,
        eps: float,
        time_step_min: float,
    ):
        self.index, self.eps, self.dt_min, self.tp = index, eps, time_step_min, tp
        H, P, N = spec.num_heads, spec.head_dim, spec.state_size
        G, W = spec.n_groups, spec.conv_kernel
        self.head_dim, self.state_size = P, N
        channels = Segment("heads", H, P)
        heads = Segment("heads", H, 1)
        groups = Segment("groups", G, N, Sharding.SPLIT_OR_REPLICATE)
        xbc = (channels, groups, groups)
        conv_dim = H * P + 2 * G * N
        in_rows = (channels, *xbc, heads)
        self.in_proj = w.rows(prefix + "in_proj.weight", in_rows, (H * P + conv_dim + H, hidden))
        self.conv = w.rows(prefix + "conv1d.weight", xbc, (conv_dim, 1, W))[:, 0]
        self.conv_bias = w.rows(prefix + "conv1d.bias", xbc, (conv_dim,))
        self.dt_bias = w.rows(prefix + "dt_bias", (heads,), (H,))
        self.A = -w.rows(prefix + "A_log", (heads,), (H,)).exp()
        self.D = w.rows(prefix + "D", (heads,), (H,))
        self.norm = w.rows(prefix + "norm.weight", (channels,), (H * P,))
        self.out_proj = w.cols(prefix + "out_proj.weight", (channels,), (hidden, H * P))
        self.heads = heads.units_per_rank(tp.size)
        self.groups = groups.units_per_rank(tp.size)
        self.split = [self.heads * P, self.heads * P, 2 * self.groups * N, self.heads]
        # A norm group spans several ranks when n_groups < TP: this rank's group, else None.
        self.shared_group = groups.units_on_rank(tp.size, tp.rank).start if tp.size > G else None
        self.num_groups, self.group_size = G, H * P // G

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """x [T, hidden] -> this rank's partial output [T, hidden]; reads and writes the
        slots' S and conv windows."""
        T, P, N, caches = x.shape[0], self.head_dim, self.state_size, batch.caches
        z, xs, bc, dt = linear(x, self.in_proj).split(self.split, dim=-1)
        conv = None if caches is None else caches.conv(self.index, "conv")
        xbc = short_conv(torch.cat([xs, bc], dim=-1), batch, conv, self.conv, self.conv_bias)
        xs, B, C = xbc.split([self.heads * P, self.groups * N, self.groups * N], dim=-1)
        xs, B, C = xs.view(T, -1, P), B.view(T, -1, N), C.view(T, -1, N)
        ssm = None if caches is None else caches.ssm(self.index)
        dt = softplus(dt + self.dt_bias)
        y = scan(batch, ssm, (xs, dt, B, C), self._ssd)
        return linear(self._gated_norm(y.reshape(T, -1), z), self.out_proj)

    def _ssd(self, part: Part, inputs, initial_state):
        xs, dt, B, C = inputs
        if part.chunked:
            return chunk_mamba2(
                xs, dt.clamp(min=self.dt_min), self.A, B, C, self.D,
                initial_state=initial_state, output_final_state=True,
                cu_seqlens=part.cu_seqlens,
            )  # fmt: skip
        return recurrent_mamba2(
            xs, dt, self.A, B, C, self.D, initial_state=initial_state, output_final_state=True,
            cu_seqlens=part.cu_seqlens,
        )  # fmt: skip

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of y * silu(z) [T, heads*P] within each of the n_groups head groups."""
        y = y * silu(z)
        T = y.shape[0]
        if self.shared_group is None:
            g = y.view(T, -1, self.group_size)
            g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
            return g.view(T, -1) * self.norm
        sums = y.new_zeros(T, self.num_groups)
        sums[:, self.shared_group] = y.pow(2).sum(-1)
        self.tp.all_reduce_(sums)
        var = sums[:, self.shared_group, None] / self.group_size
        return y * torch.rsqrt(var + self.eps) * self.norm
