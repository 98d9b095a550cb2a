"""Pieces the layers share: the step context, causal attention, paged KV reads and writes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transfer.model.caches import CacheAccess


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
