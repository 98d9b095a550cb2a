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


def tile_ends(positions: list[int]) -> dict[int, list[int]]:
    """The end of the `attend` tile of a one-row query at each position -> the indices of
    the positions whose tile ends there."""
    ends: dict[int, list[int]] = {}
    for i, position in enumerate(positions):
        ends.setdefault((position // ATTENTION_TILE + 1) * ATTENTION_TILE, []).append(i)
    return ends


def attend_one_tile(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int], scale: float
) -> torch.Tensor:
    """N one-row queries whose `attend` tiles end at the same `end`: q [N,H,D], keys
    [end,N,H,D] and values [end,N,H,Dv] zero past each sequence's length -> [N,H,Dv].

    One pair of einsums whose head axis holds every sequence's heads: each (sequence, head)
    is still its own [1,D] x [D,end] product, as in `attend` (same bits), only a loop of
    small ops per sequence fewer."""
    end, n, heads = keys.shape[0], q.shape[0], q.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q.reshape(1, n * heads, -1),
                          keys.view(end, n * heads, -1)) * scale  # fmt: skip
    at = torch.tensor(positions, device=q.device)
    visible = torch.arange(end, device=q.device)[None, :] <= at[:, None]  # [n, end]
    scores = scores.view(n, heads, 1, end).masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = scores.view(n * heads, 1, end).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values.view(end, n * heads, -1)).view(n, heads, -1)


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
