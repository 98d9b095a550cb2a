"""Pieces every layer shares: the step context, norms, RoPE, attention, paged KV, the MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from transfer.geometry import Segment
from transfer.model.caches import CacheAccess
from transfer.model.weights import WeightSource, shard_cols, shard_rows

NORM_EPS = 1e-6
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class Step:
    """One forward over one request.

    prefill: T prompt tokens from a fresh (zero) state with the chunked kernels; otherwise
    one decode token continuing from the slot's state with the recurrent kernels.
    positions [T] int64; block_ids [N] int64 on the model's device. With caches None
    (prefill only) nothing is read or written: the cache-free full-sequence forward.
    """

    prefill: bool
    positions: torch.Tensor
    block_ids: torch.Tensor
    slot: int
    caches: CacheAccess | None


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Normalise over the last dim (`weight` has that size)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * weight


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the last dim of x [T, H, D] at `positions` [T]."""
    half = x.shape[-1] // 2
    inv_freq = ROPE_THETA ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq  # [T, half]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal softmax attention; q [Tq,H,D], k [Tk,HK,D], v [Tk,HK,Dv] -> [Tq,H,Dv].

    H is a multiple of HK: query head h reads key head h // (H // HK).
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    visible = k_pos[None, :] <= q_pos[:, None]  # [Tq, Tk]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def paged_index(
    block_ids: torch.Tensor, positions: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) in the cache of each token position of a request."""
    return block_ids[positions // block_size], positions % block_size


def paged_write(
    cache: torch.Tensor, block_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
) -> None:
    """cache [NB, BS, ...] (any strides): rows [T, ...] land at the tokens' pages."""
    blocks, offsets = paged_index(block_ids, positions, cache.shape[1])
    cache[blocks, offsets] = rows.to(cache.dtype)


def paged_read(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of a request: [length, ...] gathered from its blocks."""
    positions = torch.arange(length, device=block_ids.device)
    blocks, offsets = paged_index(block_ids, positions, cache.shape[1])
    return cache[blocks, offsets].to(torch.float32)


class MLP:
    """SwiGLU; gate/up column-parallel, down row-parallel (the caller all-reduces)."""

    def __init__(self, prefix: str, hidden: int, inter: int, tp: int, rank: int, w: WeightSource):
        ffn = Segment("ffn", inter, 1)
        gate = shard_rows(w.linear(prefix + "gate", inter, hidden), ffn, tp, rank)
        up = shard_rows(w.linear(prefix + "up", inter, hidden), ffn, tp, rank)
        self.gate_up = w.place(torch.cat([gate, up]))
        self.down = w.place(shard_cols(w.linear(prefix + "down", hidden, inter), ffn, tp, rank))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.gate_up.T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.down.T
