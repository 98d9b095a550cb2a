"""Multi-head latent attention (simplified Kimi/DeepSeek MLA) over the paged cache "kv".

Each token caches [c_kv (kv_lora_rank) | k_rope (qk_rope_head_dim)], the same bytes on
every rank; query heads are split, and each rank up-projects the latent to its heads only.
"""

from __future__ import annotations

import torch

from transfer.geometry import LayerSpec, Segment
from transfer.model.layers.common import Step, attend, paged_read, paged_write, rms_norm, rope
from transfer.model.weights import WeightSource, shard_cols, shard_rows


class MLAMixer:
    def __init__(self, layer: LayerSpec, hidden: int, tp: int, rank: int, w: WeightSource):
        s = layer.spec
        self.index = layer.index
        self.rank_dim, self.rope_dim = s.kv_lora_rank, s.qk_rope_head_dim
        self.nope_dim, self.v_dim = s.qk_nope_head_dim, s.v_head_dim
        H = s.num_q_heads
        qk_dim = s.qk_nope_head_dim + s.qk_rope_head_dim
        q_heads = Segment("q_heads", H, qk_dim)
        kv_heads = Segment("kv_heads", H, s.qk_nope_head_dim + s.v_head_dim)
        o_heads = Segment("o_heads", H, s.v_head_dim)
        p = f"layers.{layer.index}.mla."
        self.q_proj = w.place(
            shard_rows(w.linear(p + "q_proj", H * qk_dim, hidden), q_heads, tp, rank)
        )
        latent = s.kv_lora_rank + s.qk_rope_head_dim
        self.kv_a_proj = w.place(w.linear(p + "kv_a_proj", latent, hidden))
        self.kv_a_norm = w.place(w.normal(p + "kv_a_norm", (s.kv_lora_rank,), 0.1, mean=1.0))
        kv_b = w.linear(p + "kv_b_proj", H * kv_heads.unit_elems, s.kv_lora_rank)
        self.kv_b_proj = w.place(shard_rows(kv_b, kv_heads, tp, rank))
        o = w.linear(p + "o_proj", hidden, H * s.v_head_dim)
        self.o_proj = w.place(shard_cols(o, o_heads, tp, rank))
        self.scale = qk_dim**-0.5

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [T, hidden] -> partial output [T, hidden]; writes the T tokens' latents."""
        T = x.shape[0]
        latent = x @ self.kv_a_proj.T
        c_kv = rms_norm(latent[:, : self.rank_dim], self.kv_a_norm)
        k_rope = rope(latent[:, None, self.rank_dim :], step.positions)[:, 0]
        entries, key_pos = torch.cat([c_kv, k_rope], dim=-1), step.positions
        if step.caches is not None:
            cache = step.caches.kv(self.index, "kv")
            paged_write(cache, step.block_ids, step.positions, entries)
            if not step.prefill:
                length = int(step.positions[-1]) + 1
                entries = paged_read(cache, step.block_ids, length)
                key_pos = torch.arange(length, device=x.device)
        c_kv, k_rope = entries.split([self.rank_dim, self.rope_dim], dim=-1)
        kv = (c_kv @ self.kv_b_proj.T).view(entries.shape[0], -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        heads = k_nope.shape[1]
        k = torch.cat([k_nope, k_rope[:, None, :].expand(-1, heads, -1)], dim=-1)
        q = (x @ self.q_proj.T).view(T, heads, -1)
        q = torch.cat([q[..., : self.nope_dim], rope(q[..., self.nope_dim :], step.positions)], -1)
        o = attend(q, k, v, step.positions, key_pos, self.scale)
        return o.reshape(T, -1) @ self.o_proj.T
