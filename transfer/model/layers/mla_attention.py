"""Kimi-Linear's multi-head latent attention, without RoPE (NoPE), sharded by query head.

Each token caches [kv latent after kv_a_layernorm (kv_lora_rank) | k_rot (qk_rope_head_dim)]
in "kv", the same bytes on every rank. Kimi-Linear applies no rotary embedding: k_rot is a
key part shared by all heads, used as it is (docs/reference.md §7).
"""

from __future__ import annotations

import torch

from transfer.geometry import MLASpec, Segment
from transfer.model.batch import Batch
from transfer.model.layers.common import attend, attend_one_tile, tile_ends
from transfer.model.layers.norms import rms_normalize
from transfer.model.layers.varlen import sequence_keys, write_kv
from transfer.model.rank_weights import RankWeights
from transfer.model.row_invariant import linear

# Kimi-Linear builds kv_a_layernorm and q_a_layernorm with the RMSNorm default eps,
# not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class KimiMLA:
    """q (q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj), the latent from kv_a_proj_with_mqa,
    the rank's heads of kv_b_proj, softmax attention, o_proj (row-parallel, caller reduces)."""

    def __init__(self, index: int, spec: MLASpec, prefix: str, w: RankWeights, hidden: int):
        self.index = index
        self.latent_dim, self.rope_dim = spec.kv_lora_rank, spec.qk_rope_head_dim
        self.nope_dim, self.v_dim = spec.qk_nope_head_dim, spec.v_head_dim
        H, qk_dim, latent = spec.num_q_heads, self.nope_dim + self.rope_dim, self.latent_dim
        q_heads = (Segment("q_heads", H, qk_dim),)
        if w.has(prefix + "q_a_proj.weight"):
            q_rank = w.checkpoint.shape(prefix + "q_a_proj.weight")[0]
            self.q_a = w.full(prefix + "q_a_proj.weight", (q_rank, hidden))
            self.q_a_norm = w.full(prefix + "q_a_layernorm.weight", (q_rank,))
            self.q_proj = w.rows(prefix + "q_b_proj.weight", q_heads, (H * qk_dim, q_rank))
        else:
            self.q_a = self.q_a_norm = None
            self.q_proj = w.rows(prefix + "q_proj.weight", q_heads, (H * qk_dim, hidden))
        self.kv_a = w.full(prefix + "kv_a_proj_with_mqa.weight", (latent + self.rope_dim, hidden))
        self.kv_a_norm = w.full(prefix + "kv_a_layernorm.weight", (latent,))
        kv_dim = self.nope_dim + self.v_dim
        kv_heads = (Segment("q_heads", H, kv_dim),)
        self.kv_b = w.rows(prefix + "kv_b_proj.weight", kv_heads, (H * kv_dim, latent))
        o_heads = (Segment("q_heads", H, self.v_dim),)
        self.o_proj = w.cols(prefix + "o_proj.weight", o_heads, (hidden, H * self.v_dim))
        self.scale = qk_dim**-0.5

    def __call__(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """x [T, hidden] -> this rank's partial output [T, hidden]; caches the T latents, then
        each sequence attends causally over its context and new tokens."""
        T = x.shape[0]
        latent, k_rot = linear(x, self.kv_a).split([self.latent_dim, self.rope_dim], dim=-1)
        latent = rms_normalize(latent, LATENT_NORM_EPS) * self.kv_a_norm
        entries, cache = torch.cat([latent, k_rot], dim=-1), None
        if batch.caches is not None:
            cache = batch.caches.kv(self.index, "kv")
            write_kv(batch, cache, entries)
        q = self._query(x).view(T, -1, self.nope_dim + self.rope_dim)
        o = q.new_empty(T, q.shape[1], self.v_dim)
        decoding = [i for i, s in enumerate(batch.sequences)
                    if cache is not None and s.context_len > 0 and len(s.tokens) == 1]  # fmt: skip
        for i in sorted(set(range(batch.num_sequences)) - set(decoding)):
            span = batch.span(i)
            k, v = self._keys_values(sequence_keys(batch, i, cache, entries))
            o[span] = attend(q[span], k, v, batch.positions[span], self.scale)
        if decoding:
            rows = [batch.bounds[i] for i in decoding]
            o[rows] = self._attend_decoding(q[rows], batch, cache, decoding)
        return linear(o.reshape(T, -1), self.o_proj)

    def _attend_decoding(
        self, q: torch.Tensor, batch: Batch, cache: torch.Tensor, members: list[int]
    ) -> torch.Tensor:
        """`attend` of one decode token per sequence in `members` (q [N,H,qk]) over its
        context and itself, bit for bit, with one gather of their latents per tile end
        instead of a read per sequence. The up-projection stays one GEMM per sequence: a
        GEMM's rows change with its row count (transfer/model/row_invariant.py)."""
        out = q.new_empty(q.shape[0], q.shape[1], self.v_dim)
        positions = [batch.sequences[i].context_len for i in members]
        block_size = cache.shape[1]
        for end, group in tile_ends(positions).items():
            lengths = [positions[j] + 1 for j in group]
            read = torch.arange(max(lengths), device=q.device)
            tables = batch.block_tables[[members[j] for j in group]].clamp(min=0)
            entries = cache[tables[:, read // block_size], read % block_size].float()
            heads = q.shape[1]
            keys = q.new_zeros(end, len(group), heads, self.nope_dim + self.rope_dim)
            values = q.new_zeros(end, len(group), heads, self.v_dim)
            for g, length in enumerate(lengths):
                kv, k_rot = self._project(entries[g, :length])
                keys[:length, g, :, : self.nope_dim] = kv[..., : self.nope_dim]
                keys[:length, g, :, self.nope_dim :] = k_rot[:, None, :]
                values[:length, g] = kv[..., self.nope_dim :]
            out[group] = attend_one_tile(q[group], keys, values, [positions[j] for j in group],
                                         self.scale)  # fmt: skip
        return out

    def _project(self, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """entries [L, latent + rope] -> kv [L, H, nope + v] (this rank's heads, up-projected
        from the latent) and the shared rotary key part k_rot [L, rope]."""
        latent, k_rot = entries.split([self.latent_dim, self.rope_dim], dim=-1)
        kv = linear(latent, self.kv_b).view(entries.shape[0], -1, self.nope_dim + self.v_dim)
        return kv, k_rot

    def _keys_values(self, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """entries [L, latent + rope] -> this rank's heads' keys [L, H, qk] and values [L, H, v]."""
        kv, k_rot = self._project(entries)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot[:, None, :].expand(-1, k_nope.shape[1], -1)], dim=-1)
        return k, v

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_a is None:
            return linear(x, self.q_proj)
        latent = rms_normalize(linear(x, self.q_a), LATENT_NORM_EPS) * self.q_a_norm
        return linear(latent, self.q_proj)
