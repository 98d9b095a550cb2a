"""Grouped-query attention over the paged KV cache ("k", "v"), with a sigmoid output gate.

Query heads are split over the ranks; KV heads too, or replicated when there are fewer
KV heads than ranks (`Segment.units_on_rank` picks the head a rank holds).
"""

from __future__ import annotations

import torch

from transfer.geometry import LayerSpec
from transfer.model.layers.common import Step, attend, paged_read, paged_write, rms_norm, rope
from transfer.model.weights import WeightSource, shard_cols, shard_rows


class GQAMixer:
    def __init__(self, layer: LayerSpec, hidden: int, tp: int, rank: int, w: WeightSource):
        s = layer.spec
        self.index = layer.index
        self.head_dim = s.head_dim
        (q_seg,) = s.compute_segments()
        (kv_seg,) = next(t for t in layer.cache_tensors() if t.name == "k").segments
        p = f"layers.{layer.index}.gqa."
        q_dim, kv_dim = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.q_proj = w.place(shard_rows(w.linear(p + "q_proj", q_dim, hidden), q_seg, tp, rank))
        self.gate_proj = w.place(
            shard_rows(w.linear(p + "gate_proj", q_dim, hidden), q_seg, tp, rank)
        )
        self.k_proj = w.place(shard_rows(w.linear(p + "k_proj", kv_dim, hidden), kv_seg, tp, rank))
        self.v_proj = w.place(shard_rows(w.linear(p + "v_proj", kv_dim, hidden), kv_seg, tp, rank))
        self.q_norm = w.place(w.normal(p + "q_norm", (s.head_dim,), 0.1, mean=1.0))
        self.k_norm = w.place(w.normal(p + "k_norm", (s.head_dim,), 0.1, mean=1.0))
        self.o_proj = w.place(shard_cols(w.linear(p + "o_proj", hidden, q_dim), q_seg, tp, rank))

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [T, hidden] -> partial output [T, hidden]; writes the T tokens' K/V."""
        T, D = x.shape[0], self.head_dim
        q = rope(rms_norm((x @ self.q_proj.T).view(T, -1, D), self.q_norm), step.positions)
        k = rope(rms_norm((x @ self.k_proj.T).view(T, -1, D), self.k_norm), step.positions)
        v = (x @ self.v_proj.T).view(T, -1, D)
        keys, values, key_pos = k, v, step.positions
        if step.caches is not None:
            k_cache = step.caches.kv(self.index, "k")
            v_cache = step.caches.kv(self.index, "v")
            paged_write(k_cache, step.block_ids, step.positions, k)
            paged_write(v_cache, step.block_ids, step.positions, v)
            if not step.prefill:
                length = int(step.positions[-1]) + 1
                keys = paged_read(k_cache, step.block_ids, length)
                values = paged_read(v_cache, step.block_ids, length)
                key_pos = torch.arange(length, device=x.device)
        o = attend(q, keys, values, step.positions, key_pos, D**-0.5)
        o = o * torch.sigmoid((x @ self.gate_proj.T).view(T, -1, D))
        return o.reshape(T, -1) @ self.o_proj.T
