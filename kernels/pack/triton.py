"""Triton pack/unpack: byte ranges of a flat arena <-> a staging buffer, and paged blocks.

All index math is int64: program ids and loaded offsets are widened before any
multiply, so arenas and staging buffers past 2 GiB address correctly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A range is split into pieces of at most CHUNK_WORDS words, one program each, so one huge
# range still spreads over the whole GPU; the program copies its piece BLOCK_WORDS at a time.
CHUNK_WORDS = 8192
BLOCK_WORDS = 1024
# Integer dtype of each width: copies move raw bits (no float canonicalisation).
INT_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _copy_pieces_kernel(
    src,  # words
    dst,  # words
    src_starts,  # [P] int64, in words
    dst_starts,  # [P] int64, in words
    piece_words,  # [P] int64
    BLOCK: tl.constexpr,
):
    piece = tl.program_id(0).to(tl.int64)
    src_start = tl.load(src_starts + piece)
    dst_start = tl.load(dst_starts + piece)
    count = tl.load(piece_words + piece)
    for i in tl.range(0, count, BLOCK):
        offs = i + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < count
        tl.store(dst + dst_start + offs, tl.load(src + src_start + offs, mask=mask), mask=mask)


@triton.jit
def _copy_blocks_kernel(
    src,
    dst,
    block_ids,  # [n] int64
    heads_x_dim,  # (head_end - head_start) * head_dim
    head_dim,
    block_size,
    s_src0,
    s_src1,
    s_src2,
    s_src3,
    s_dst0,
    s_dst1,
    s_dst2,
    s_dst3,
    GATHER: tl.constexpr,  # True: src is the cache (indexed by block id), dst the staging
    BLOCK_T: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1).to(tl.int64)
    block = tl.load(block_ids + i)
    src_block = block if GATHER else i
    dst_block = i if GATHER else block
    t = i_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    t_mask = t < block_size
    src_rows = src + src_block * s_src0 + t[:, None] * s_src1
    dst_rows = dst + dst_block * s_dst0 + t[:, None] * s_dst1
    for j0 in tl.range(0, heads_x_dim, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J).to(tl.int64)
        head = j // head_dim
        e = j % head_dim
        mask = t_mask[:, None] & (j < heads_x_dim)[None, :]
        values = tl.load(src_rows + (head * s_src2 + e * s_src3)[None, :], mask=mask)
        tl.store(dst_rows + (head * s_dst2 + e * s_dst3)[None, :], values, mask=mask)


def word_size(alignment: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides `alignment`."""
    return next(w for w in (8, 4, 2, 1) if alignment % w == 0)


def copy_ranges_triton(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_offsets: torch.Tensor,
    dst_offsets: torch.Tensor,
    lengths: torch.Tensor,
    word: int,
) -> None:
    """Copy src[src_offsets[r] :+ lengths[r]] to dst[dst_offsets[r] :+ lengths[r]] (uint8 [N]).

    `word` (8, 4, 2 or 1) divides every offset, length and both base addresses; the
    copy then moves whole words.
    """
    device = src.device
    lengths = lengths.to(device) // word
    counts = (lengths + CHUNK_WORDS - 1) // CHUNK_WORDS
    owner = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)
    if len(owner) == 0:
        return
    first_piece = torch.cumsum(counts, 0) - counts
    within = (torch.arange(len(owner), device=device) - first_piece[owner]) * CHUNK_WORDS
    src_starts = src_offsets.to(device)[owner] // word + within
    dst_starts = dst_offsets.to(device)[owner] // word + within
    piece_words = torch.clamp(lengths[owner] - within, max=CHUNK_WORDS)
    src_words = src[: src.numel() // word * word].view(INT_DTYPES[word])
    dst_words = dst[: dst.numel() // word * word].view(INT_DTYPES[word])
    _copy_pieces_kernel[(len(owner),)](
        src_words, dst_words, src_starts, dst_starts, piece_words, BLOCK=BLOCK_WORDS
    )


def copy_blocks_triton(
    cache: torch.Tensor,
    staging: torch.Tensor,
    block_ids: torch.Tensor,
    head_start: int,
    head_end: int,
    gather: bool,
) -> None:
    """gather: staging[i] = cache[block_ids[i], :, heads]; else the reverse. Bit-exact."""
    num_ids = len(block_ids)
    block_size, head_dim = cache.shape[1], cache.shape[3]
    heads_x_dim = (head_end - head_start) * head_dim
    if num_ids == 0 or heads_x_dim == 0:
        return
    as_int = INT_DTYPES[cache.element_size()]
    heads = cache[:, :, head_start:head_end].view(as_int)
    staging = staging.view(as_int)
    src, dst = (heads, staging) if gather else (staging, heads)
    block_t = min(triton.next_power_of_2(block_size), 16)
    grid = (num_ids, triton.cdiv(block_size, block_t))
    _copy_blocks_kernel[grid](
        src, dst, block_ids.to(device=cache.device, dtype=torch.int64),
        heads_x_dim, head_dim, block_size, *src.stride(), *dst.stride(),
        GATHER=gather,
        BLOCK_T=block_t,
        BLOCK_J=min(triton.next_power_of_2(heads_x_dim), 256),
    )  # fmt: skip
