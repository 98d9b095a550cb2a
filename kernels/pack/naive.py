"""Reference pack/unpack: plain torch slicing and indexing, one range or block at a time."""

from __future__ import annotations

import torch


def gather_ranges_naive(
    src: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Copy src[offsets[r] : offsets[r] + lengths[r]] for each r, in order, into out."""
    position = 0
    for offset, length in zip(offsets.tolist(), lengths.tolist(), strict=True):
        out[position : position + length] = src[offset : offset + length]
        position += length
    return out


def scatter_ranges_naive(
    staging: torch.Tensor, dst: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor
) -> None:
    """The inverse of gather_ranges_naive: consecutive pieces of staging go to dst ranges."""
    position = 0
    for offset, length in zip(offsets.tolist(), lengths.tolist(), strict=True):
        dst[offset : offset + length] = staging[position : position + length]
        position += length


def copy_ranges_naive(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_offsets: torch.Tensor,
    dst_offsets: torch.Tensor,
    lengths: torch.Tensor,
) -> None:
    """dst[dst_offsets[r] :+ lengths[r]] = src[src_offsets[r] :+ lengths[r]] for each r."""
    rows = zip(src_offsets.tolist(), dst_offsets.tolist(), lengths.tolist(), strict=True)
    if src.device.type == "cpu" and dst.device.type == "cpu":
        # numpy views: a small slice copy costs a fraction of torch's per-call overhead
        src, dst = src.numpy(), dst.numpy()
    for s, d, n in rows:
        dst[d : d + n] = src[s : s + n]


def gather_blocks_naive(
    cache: torch.Tensor, block_ids: torch.Tensor, head_start: int, head_end: int, out: torch.Tensor
) -> torch.Tensor:
    """out [n, block_size, head_end-head_start, head_dim] = cache[block_ids, :, heads]."""
    out.copy_(cache[block_ids.to(cache.device), :, head_start:head_end])
    return out


def scatter_blocks_naive(
    staging: torch.Tensor,
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    head_start: int,
    head_end: int,
) -> None:
    """cache[block_ids, :, heads] = staging, in place (cache may be a strided view)."""
    cache[block_ids.to(cache.device), :, head_start:head_end] = staging
