"""Pack/unpack for the transfer: byte ranges of a flat arena, and paged KV blocks.

Offsets are int64 everywhere, so arenas and staging buffers past 2 GiB work.
"""

from __future__ import annotations

import torch

from kernels.backend import use_triton
from kernels.pack.naive import (
    copy_ranges_naive,
    gather_blocks_naive,
    gather_ranges_naive,
    scatter_blocks_naive,
    scatter_ranges_naive,
)

__all__ = ["gather_ranges", "scatter_ranges", "copy_ranges", "gather_blocks", "scatter_blocks"]


def gather_ranges(
    src: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy R byte ranges of src uint8 [N] into one contiguous buffer, in order.

    offsets, lengths: int64 [R] (on the CPU or src's device); ranges may overlap
    and sit anywhere. out: uint8 [sum(lengths)] on src's device, allocated when None.
    """
    total, alignment = _check_ranges("src", src, offsets, lengths, overlap_ok=True)
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=src.device)
    else:
        _check_flat("out", out, src.device, total)
    if use_triton(src, out):
        from kernels.pack.triton import copy_ranges_triton

        copy_ranges_triton(src, out, offsets, _starts(lengths), lengths, alignment)
        return out
    return gather_ranges_naive(src, offsets, lengths, out)


def scatter_ranges(
    staging: torch.Tensor, dst: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor
) -> None:
    """The inverse of gather_ranges: consecutive pieces of staging go to dst's ranges.

    staging uint8 [sum(lengths)]; dst uint8 [N], written in place; offsets, lengths
    int64 [R]. Destination ranges must not overlap.
    """
    total, alignment = _check_ranges("dst", dst, offsets, lengths, overlap_ok=False)
    _check_flat("staging", staging, dst.device, total)
    if use_triton(staging, dst):
        from kernels.pack.triton import copy_ranges_triton

        copy_ranges_triton(staging, dst, _starts(lengths), offsets, lengths, alignment)
        return
    scatter_ranges_naive(staging, dst, offsets, lengths)


def copy_ranges(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_offsets: torch.Tensor,
    dst_offsets: torch.Tensor,
    lengths: torch.Tensor,
) -> None:
    """Copy src[src_offsets[r] :+ lengths[r]] to dst[dst_offsets[r] :+ lengths[r]] for each r:
    gather and scatter in one pass, for pieces that are not back to back on either side.

    src, dst: contiguous uint8 [N] on one device (may be one tensor: then no source range
    may overlap a destination range); offsets, lengths int64 [R]. Destination ranges must
    not overlap; source ranges may.
    """
    _, src_alignment = _check_ranges("src", src, src_offsets, lengths, overlap_ok=True)
    _, dst_alignment = _check_ranges("dst", dst, dst_offsets, lengths, overlap_ok=False)
    if src.device != dst.device:
        raise ValueError(f"dst: expected device {src.device} like src, got {dst.device}")
    if use_triton(src, dst):
        from kernels.pack.triton import copy_ranges_triton

        alignment = min(src_alignment, dst_alignment)
        copy_ranges_triton(src, dst, src_offsets, dst_offsets, lengths, alignment)
        return
    copy_ranges_naive(src, dst, src_offsets, dst_offsets, lengths)


def gather_blocks(
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    head_start: int = 0,
    head_end: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather whole blocks, or a head slice of them, from a paged cache.

    cache [num_blocks, block_size, num_heads, head_dim], any strides (a view of an
    arena); block_ids int [n]; heads [head_start, head_end). Returns out
    [n, block_size, head_end-head_start, head_dim], bit-exact.
    """
    head_end = _check_blocks(cache, block_ids, head_start, head_end)
    shape = (len(block_ids), cache.shape[1], head_end - head_start, cache.shape[3])
    if out is None:
        out = cache.new_empty(shape)
    else:
        _check_staging("out", out, cache, shape)
    if use_triton(cache, out):
        from kernels.pack.triton import copy_blocks_triton

        copy_blocks_triton(cache, out, block_ids, head_start, head_end, gather=True)
        return out
    return gather_blocks_naive(cache, block_ids, head_start, head_end, out)


def scatter_blocks(
    staging: torch.Tensor,
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    head_start: int = 0,
    head_end: int | None = None,
) -> None:
    """The inverse of gather_blocks: write staging [n, block_size, heads, head_dim] into
    cache[block_ids, :, head_start:head_end] in place. block_ids must be distinct."""
    head_end = _check_blocks(cache, block_ids, head_start, head_end)
    shape = (len(block_ids), cache.shape[1], head_end - head_start, cache.shape[3])
    _check_staging("staging", staging, cache, shape)
    if len(block_ids) and len(torch.unique(block_ids)) != len(block_ids):
        raise ValueError(f"block_ids: scatter needs distinct ids, got {block_ids.tolist()}")
    if use_triton(staging, cache):
        from kernels.pack.triton import copy_blocks_triton

        copy_blocks_triton(cache, staging, block_ids, head_start, head_end, gather=False)
        return
    scatter_blocks_naive(staging, cache, block_ids, head_start, head_end)


def _starts(lengths: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum: where each range begins in the staging buffer."""
    return torch.cumsum(lengths, 0) - lengths


def _check_ranges(
    name: str, arena: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor, overlap_ok: bool
) -> tuple[int, int]:
    """Validate byte ranges of arena with one device-to-host read.

    Returns (total bytes, alignment): alignment is the largest of 16, 8, 4, 2, 1 that
    divides every offset and length.
    """
    _check_flat(name, arena, arena.device, None)
    for arg, tensor in (("offsets", offsets), ("lengths", lengths)):
        if tensor.dtype != torch.int64 or tensor.dim() != 1:
            raise ValueError(
                f"{arg}: expected int64 [R], got {tensor.dtype} shape {tuple(tensor.shape)}"
            )
        if tensor.device not in (arena.device, torch.device("cpu")):
            raise ValueError(f"{arg}: expected the CPU or {arena.device}, got {tensor.device}")
    if offsets.shape != lengths.shape:
        raise ValueError(
            f"offsets, lengths: expected the same shape [R], got {tuple(offsets.shape)} "
            f"and {tuple(lengths.shape)}"
        )
    if len(offsets) == 0:
        return 0, 16
    lengths = lengths.to(offsets.device)
    ends = offsets + lengths
    bits = offsets | lengths
    stats = [offsets.min(), lengths.min(), ends.max(), lengths.sum()]
    stats += [(bits % w == 0).all() for w in (16, 8, 4, 2)]
    if not overlap_ok:
        order = torch.argsort(offsets)
        starts, nonempty = offsets[order], lengths[order] > 0
        reach = torch.cummax(torch.where(nonempty, ends[order], 0), 0).values
        stats.append((nonempty[1:] & (starts[1:] < reach[:-1])).any())
    stats = torch.stack([torch.as_tensor(v, dtype=torch.int64) for v in stats]).tolist()
    min_offset, min_length, max_end, total = stats[:4]
    if min_offset < 0:
        raise ValueError(f"offsets: expected >= 0, got min {min_offset}")
    if min_length < 0:
        raise ValueError(f"lengths: expected >= 0, got min {min_length}")
    if max_end > arena.numel():
        raise ValueError(
            f"offsets + lengths: range end {max_end} past {name} of {arena.numel()} bytes"
        )
    if not overlap_ok and stats[8]:
        raise ValueError(f"offsets, lengths: destination ranges in {name} overlap")
    alignment = next((w for w, ok in zip((16, 8, 4, 2), stats[4:8], strict=True) if ok), 1)
    return total, alignment


def _check_flat(name: str, tensor: torch.Tensor, device: torch.device, numel: int | None) -> None:
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(
            f"{name}: expected contiguous uint8 [N], got {tensor.dtype} shape {tuple(tensor.shape)}"
        )
    if tensor.device != device:
        raise ValueError(f"{name}: expected device {device}, got {tensor.device}")
    if numel is not None and tensor.numel() != numel:
        raise ValueError(f"{name}: expected [{numel}] (sum of lengths), got [{tensor.numel()}]")


def _check_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, head_start: int, head_end: int | None
) -> int:
    """Validate a paged cache, block ids and head range; returns head_end."""
    if cache.dim() != 4:
        raise ValueError(
            f"cache: expected [num_blocks, block_size, num_heads, head_dim], got shape "
            f"{tuple(cache.shape)}"
        )
    num_blocks, _, num_heads, _ = cache.shape
    if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
        raise ValueError(
            f"block_ids: expected int [n], got {block_ids.dtype} shape {tuple(block_ids.shape)}"
        )
    if block_ids.device not in (cache.device, torch.device("cpu")):
        raise ValueError(f"block_ids: expected the CPU or {cache.device}, got {block_ids.device}")
    if len(block_ids):
        low, high = torch.stack([block_ids.min(), block_ids.max()]).tolist()
        if low < 0 or high >= num_blocks:
            raise ValueError(
                f"block_ids: expected ids in [0, {num_blocks}) for cache shape "
                f"{tuple(cache.shape)}, got min {low} max {high}"
            )
    head_end = num_heads if head_end is None else head_end
    if not 0 <= head_start < head_end <= num_heads:
        raise ValueError(
            f"head_start, head_end: expected 0 <= head_start < head_end <= num_heads={num_heads}, "
            f"got [{head_start}, {head_end})"
        )
    return head_end


def _check_staging(
    name: str, staging: torch.Tensor, cache: torch.Tensor, shape: tuple[int, ...]
) -> None:
    if tuple(staging.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(staging.shape)}")
    if staging.dtype != cache.dtype or staging.device != cache.device:
        raise ValueError(
            f"{name}: expected {cache.dtype} on {cache.device} like cache, got "
            f"{staging.dtype} on {staging.device}"
        )
