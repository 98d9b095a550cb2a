"""Pieces the layers share: the step context, causal attention, paged KV reads and writes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from transfer.model.caches import CacheAccess

# Called with a cache-bearing layer's index once a step has written that layer's caches.
AfterLayer = Callable[[int], None]


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


ATTENTION_TILE = 64  # query positions per tile of `attend`


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal softmax attention of one sequence's chunk; q [Tq,H,D] at positions q_pos (one
    run), k [Tk,HK,D] and v [Tk,HK,Dv] at positions 0..Tk-1 -> [Tq,H,Dv].

    H is a multiple of HK: query head h reads key head h // (H // HK). Queries run in tiles
    of `ATTENTION_TILE` positions counted from 0, and each tile reduces over exactly the
    key positions below its end (zero-padded past Tk), so a row's bits depend on its
    position alone, not on where the pass began or ended: a prefix-cache hit, a chunked
    prefill and a fresh prefill write the same bits.
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    first, start = int(q_pos[0]), 0
    while start < q.shape[0]:
        end = ((first + start) // ATTENTION_TILE + 1) * ATTENTION_TILE
        stop = min(q.shape[0], end - first)
        keys, values = _padded(k, end), _padded(v, end)
        scores = torch.einsum("qhd,khd->hqk", q[start:stop], keys) * scale
        visible = torch.arange(end, device=q.device)[None, :] <= q_pos[start:stop, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:stop] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        start = stop
    return out


def _padded(x: torch.Tensor, length: int) -> torch.Tensor:
    """x [T, ...] cut or zero-padded to [length, ...]."""
    if x.shape[0] >= length:
        return x[:length]
    return torch.cat([x, x.new_zeros(length - x.shape[0], *x.shape[1:])])


def paged_index(
    block_ids: torch.Tensor, positions: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) in the cache of each token position of a request."""
    return block_ids[positions // block_size], positions % block_size


def paged_read(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of a request: [length, ...] gathered from its blocks."""
    positions = torch.arange(length, device=block_ids.device)
    blocks, offsets = paged_index(block_ids, positions, cache.shape[1])
    return cache[blocks, offsets].to(torch.float32)
