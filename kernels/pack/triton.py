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
    VEC: tl.constexpr,  # every start and count is a multiple of VEC words (16-byte alignment)
    BLOCK: tl.constexpr,
):
    piece = tl.program_id(0).to(tl.int64)
    # the hints let the compiler emit 16-byte vector loads and stores
    src_start = tl.multiple_of(tl.load(src_starts + piece), VEC)
    dst_start = tl.multiple_of(tl.load(dst_starts + piece), VEC)
    count = tl.multiple_of(tl.load(piece_words + piece), VEC)
    for i in tl.range(0, count, BLOCK):
        offs = i + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < count
        tl.store(dst + dst_start + offs, tl.load(src + src_start + offs, mask=mask), mask=mask)


@triton.jit
def _copy_blocks_kernel(
    src,
    dst,
    block_ids,  # [n] int64
    num_heads,  # head_end - head_start
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
    BLOCK_D: tl.constexpr,
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
    for h in tl.range(0, num_heads):
        head = tl.cast(h, tl.int64)
        for d0 in tl.range(0, head_dim, BLOCK_D):
            e = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
            mask = t_mask[:, None] & (e < head_dim)[None, :]
            values = tl.load(src_rows + head * s_src2 + e[None, :] * s_src3, mask=mask)
            tl.store(dst_rows + head * s_dst2 + e[None, :] * s_dst3, values, mask=mask)


def copy_ranges_triton(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_offsets: torch.Tensor,
    dst_offsets: torch.Tensor,
    lengths: torch.Tensor,
    alignment: int,
) -> None:
    """Copy src[src_offsets[r] :+ lengths[r]] to dst[dst_offsets[r] :+ lengths[r]] (uint8 [N]).

    `alignment` (a power of two) divides every offset and length; with the base
    addresses it picks the widest word (up to 8 bytes) and 16-byte vectors.
    """
    lowest = alignment | src.data_ptr() | dst.data_ptr()
    word = next(w for w in (8, 4, 2, 1) if lowest % w == 0)
    vec = 2 if lowest % 16 == 0 else 1
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
        src_words, dst_words, src_starts, dst_starts, piece_words, VEC=vec, BLOCK=BLOCK_WORDS
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
    if num_ids == 0:
        return
    as_int = INT_DTYPES[cache.element_size()]
    heads = cache[:, :, head_start:head_end].view(as_int)
    staging = staging.view(as_int)
    src, dst = (heads, staging) if gather else (staging, heads)
    block_t = min(triton.next_power_of_2(block_size), 16)
    grid = (num_ids, triton.cdiv(block_size, block_t))
    _copy_blocks_kernel[grid](
        src, dst, block_ids.to(device=cache.device, dtype=torch.int64),
        head_end - head_start, head_dim, block_size, *src.stride(), *dst.stride(),
        GATHER=gather,
        BLOCK_T=block_t,
        BLOCK_D=min(triton.next_power_of_2(head_dim), 256),
    )  # fmt: skip
