"""Elementary copies of one request for one decode rank, from its `copies.RankCopies`:
byte ranges per source prefill rank, unsorted. Coalescing happens later."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from transfer.packer.copies import RankCopies, SourceCopies
from transfer.packer.request import TransferRequest


class RequestIndices(NamedTuple):
    """A request's part, as indices to expand `SourceCopies` with: per token (a row), its
    block id and position in it on each side (none without KV blocks); per slot pair (a
    column), the two slots."""

    num_tokens: int
    src_block: np.ndarray
    src_pos: np.ndarray
    dst_block: np.ndarray
    dst_pos: np.ndarray
    src_slots: np.ndarray
    dst_slots: np.ndarray


def request_indices(
    request: TransferRequest,
    src_block_size: int,
    dst_block_size: int,
    tokens: tuple[int, int] | None,
) -> RequestIndices:
    """The indices of `request`'s tokens `[start, end)` (None: all) and of its slots."""
    start, end = tokens or (0, request.num_tokens)
    # A model without attention layers has no blocks (validated): no token to index.
    t = np.arange(start, end if request.src_blocks else start, dtype=np.int64)
    src_blocks = np.asarray(request.src_blocks, dtype=np.int64)
    dst_blocks = np.asarray(request.dst_blocks, dtype=np.int64)
    return RequestIndices(
        end - start,
        src_blocks[t // src_block_size],
        t % src_block_size,
        dst_blocks[t // dst_block_size],
        t % dst_block_size,
        np.asarray(request.src_slots, dtype=np.int64).reshape(-1, 1),
        np.asarray(request.dst_slots, dtype=np.int64).reshape(-1, 1),
    )


def merge_neighbours(
    src: np.ndarray, dst: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge each copy into the one before it where the two are adjacent on both sides."""
    if len(lengths) == 0:
        return src, dst, lengths
    ends_src, ends_dst = src[:-1] + lengths[:-1], dst[:-1] + lengths[:-1]
    starts = np.ones(len(lengths), dtype=bool)
    starts[1:] = (ends_src != src[1:]) | (ends_dst != dst[1:])
    first = np.flatnonzero(starts)
    return src[first], dst[first], np.add.reduceat(lengths, first)


class Pieces(NamedTuple):
    """Unsorted copies from one prefill rank, flat int64, and the bytes they move."""

    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray
    kv_bytes: int
    state_bytes: int


def _source_pieces(s: SourceCopies, at: RequestIndices) -> Pieces:
    # KV copies expand to [copy, token] (a unit's tokens in order), state copies to [slot,
    # copy] (a slot's steps in order); flattened, neighbours are next to each other.
    tokens, slots = len(at.src_block), len(at.src_slots)
    src = np.concatenate(
        (
            s.kv_src + s.kv_src_block * at.src_block + s.kv_src_token * at.src_pos,
            s.state_src + at.src_slots * s.state_src_slot,
        ),
        axis=None,
    )
    dst = np.concatenate(
        (
            s.kv_dst + s.kv_dst_block * at.dst_block + s.kv_dst_token * at.dst_pos,
            s.state_dst + at.dst_slots * s.state_dst_slot,
        ),
        axis=None,
    )
    lengths = np.concatenate(
        (np.repeat(s.kv_nbytes, tokens, axis=1), np.repeat(s.state_nbytes, slots, axis=0)),
        axis=None,
    )
    # Merge neighbours in index order now (tokens of a block, steps of a window): the
    # global sort and coalesce later then see a few ranges per unit, not one per token.
    return Pieces(
        *merge_neighbours(src, dst, lengths),
        s.kv_bytes_per_token * tokens,
        s.state_bytes_per_slot * slots,
    )


def request_pieces(rank: RankCopies, at: RequestIndices) -> dict[int, Pieces]:
    """Per source prefill rank (in rank order), the copies `rank` makes for the request
    part `at`. A source is left out when the part needs nothing from it (no tokens to
    read and no state)."""
    with_kv = len(at.src_block) > 0
    return {
        s.rank: _source_pieces(s, at)
        for s in rank.sources
        if (with_kv and s.kv_src.size) or s.state_src.size
    }
