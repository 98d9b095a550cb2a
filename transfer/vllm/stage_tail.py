"""The partial last attention block of a request, gathered on prefill and scattered on decode.

vLLM's CPU attention keeps one head's part of a block as K dim-major then V token-major:

    run = unit.base + block * unit.block_stride          (the K unit's base: the head's run)
    K[d][t] at run + (d * block_size + t) * eb           d < head_dim, t < block_size
    V[t]    at run + head_dim * block_size * eb + t * head_dim * eb   (head_dim * eb bytes)

so the first `n` tokens of a block are `head_dim + 1` ranges per head, not one. Prefill
gathers them, once its forward has written them, into a stage slot: per K unit of the rank,
in the layout's order, one chunk `K[:, :n]` (dim-major) then `V[:n]`, chunks back to back.
Decode reads the chunks of its heads (adjacent chunks as one range) into its landing buffer
and scatters them into its own block with the same formula. Full blocks still cross whole.

Decode zeroes its block's head runs before the scatter: vLLM does not zero blocks a
connector loads, and the block may last have held a mamba page, whose float32 bytes read
as bf16 include NaNs; the kernel multiplies masked-out positions' V by 0, and 0 * NaN is
NaN (a 300-token prompt then decoded [0, 0, ...]).

Offsets are virtual (each rank's registered regions); everything here is numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from transfer.cache.explicit_layout import ExplicitLayout
from transfer.cache.head_units import KVUnit
from transfer.errors import InvalidInput

# Stage slots per prefill rank: partial blocks of this many finished prefills wait for
# decode at once; a prefill that finds none free publishes whole blocks.
STAGE_SLOTS = 16

Copies = tuple[np.ndarray, np.ndarray, np.ndarray]  # (src, dst, nbytes) int64


def k_units(layout: ExplicitLayout) -> tuple[KVUnit, ...]:
    """The rank's K units in stage order; () when some KV tensor is not GQA's k|v pair (an
    MLA latent is token-major: those blocks keep crossing whole)."""
    if not layout.kv or any(u.tensor not in ("k", "v") for u in layout.kv):
        return ()
    return tuple(u for u in layout.kv if u.tensor == "k")


def slot_bytes(layout: ExplicitLayout) -> int:
    """Bytes of one stage slot: a whole block of every K|V head of the rank (0: no tail
    staging for this layout)."""
    return sum(2 * u.nbytes * layout.block_size for u in k_units(layout))


def _chunk_bytes(unit: KVUnit, tokens: int) -> int:
    return 2 * unit.nbytes * tokens


def _head_copies(
    unit: KVUnit, block_size: int, eb: int, block: int, tokens: int, chunk_at: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cache offset, chunk offset, nbytes) of one head's first `tokens` tokens."""
    head_dim = unit.nbytes // eb
    run = unit.base + block * unit.block_stride
    rows = np.arange(head_dim, dtype=np.int64)
    cache = np.append(run + rows * block_size * eb, run + head_dim * block_size * eb)
    chunk = np.append(chunk_at + rows * tokens * eb, chunk_at + head_dim * tokens * eb)
    nbytes = np.append(np.full(head_dim, tokens * eb, dtype=np.int64), tokens * unit.nbytes)
    return cache, chunk, nbytes


def head_token_ranges(
    unit: KVUnit, block_size: int, eb: int, block: int, tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, nbytes) in the cache of one head's first `tokens` tokens of `block` (the
    bytes decode's scatter writes), in stage-chunk order."""
    cache, _, nbytes = _head_copies(unit, block_size, eb, block, tokens, 0)
    return cache, nbytes


def _check(layout: ExplicitLayout, tokens: int, field: str) -> None:
    if not k_units(layout):
        raise InvalidInput(f"{field}: this layout's attention cannot be staged by token")
    if not 0 < tokens < layout.block_size:
        raise InvalidInput(
            f"{field}: {tokens} tokens is not a partial block of {layout.block_size}"
        )


def gather_copies(layout: ExplicitLayout, block: int, tokens: int, slot_at: int) -> Copies:
    """Prefill: copies of the first `tokens` tokens of `block` into the slot at `slot_at`."""
    _check(layout, tokens, "stage gather")
    eb, cursor, parts = layout.dtypes.kv, slot_at, []
    for unit in k_units(layout):
        cache, chunk, nbytes = _head_copies(unit, layout.block_size, eb, block, tokens, cursor)
        parts.append((cache, chunk, nbytes))
        cursor += _chunk_bytes(unit, tokens)
    return tuple(np.concatenate(c) for c in zip(*parts, strict=True))  # type: ignore[return-value]


@dataclass(frozen=True)
class TailReads:
    """Decode's reads of a staged tail and its scatter.

    per_source: prefill rank -> (src, dst, nbytes), dst relative to the landing buffer.
    copies: (src relative to the landing buffer, dst in decode's memory, nbytes).
    clear: (offset, nbytes) in decode's memory: the block's head runs, to zero first.
    """

    per_source: dict[int, Copies]
    copies: Copies
    nbytes: int
    clear: tuple[np.ndarray, np.ndarray]

    def shifted(self, landing_at: int) -> tuple[dict[int, Copies], Copies]:
        """Reads and copies with the landing buffer placed at `landing_at`."""
        reads = {p: (s, d + landing_at, n) for p, (s, d, n) in self.per_source.items()}
        src, dst, n = self.copies
        return reads, (src + landing_at, dst, n)


def _coalesce(src: list[int], dst: list[int], nbytes: list[int]) -> Copies:
    out_s, out_d, out_n = [src[0]], [dst[0]], [nbytes[0]]
    for s, d, n in zip(src[1:], dst[1:], nbytes[1:], strict=True):
        if s == out_s[-1] + out_n[-1] and d == out_d[-1] + out_n[-1]:
            out_n[-1] += n
        else:
            out_s.append(s), out_d.append(d), out_n.append(n)
    return tuple(np.asarray(c, dtype=np.int64) for c in (out_s, out_d, out_n))  # type: ignore[return-value]


def tail_reads(
    prefill: Sequence[ExplicitLayout],
    decode: ExplicitLayout,
    slot_offsets: Sequence[int],
    dst_block: int,
    tokens: int,
) -> TailReads:
    """Decode's reads of the staged first `tokens` tokens of a partial block (prefill rank
    `p`'s slot at `slot_offsets[p]`) into a landing buffer, and the copies into `dst_block`."""
    if len(slot_offsets) != len(prefill):
        raise InvalidInput(
            f"ticket staged_offsets: {len(slot_offsets)} offsets for {len(prefill)} prefill ranks"
        )
    _check(decode, tokens, "decode tail")
    where: dict[tuple[int, int], tuple[int, int]] = {}  # (layer, head) -> (rank, chunk at)
    for rank, layout in enumerate(prefill):
        _check(layout, tokens, f"prefill rank {rank} tail")
        cursor = slot_offsets[rank]
        for unit in k_units(layout):
            where.setdefault((unit.layer, unit.unit), (rank, cursor))
            cursor += _chunk_bytes(unit, tokens)
    reads: dict[int, tuple[list[int], list[int], list[int]]] = {}
    copies, landing, runs = [], 0, []
    for unit in k_units(decode):
        runs.append(unit.base + dst_block * unit.block_stride)
        if (unit.layer, unit.unit) not in where:
            raise InvalidInput(f"prefill holds no K|V of layer {unit.layer} head {unit.unit}")
        rank, chunk_at = where[unit.layer, unit.unit]
        size = _chunk_bytes(unit, tokens)
        s, d, n = reads.setdefault(rank, ([], [], []))
        s.append(chunk_at), d.append(landing), n.append(size)
        cache, chunk, nbytes = _head_copies(
            unit, decode.block_size, decode.dtypes.kv, dst_block, tokens, landing
        )
        copies.append((chunk, cache, nbytes))
        landing += size
    per_source = {rank: _coalesce(*columns) for rank, columns in sorted(reads.items())}
    joined = tuple(np.concatenate(c) for c in zip(*copies, strict=True))
    run_bytes = [2 * u.nbytes * decode.block_size for u in k_units(decode)]
    clear = (np.asarray(runs, dtype=np.int64), np.asarray(run_bytes, dtype=np.int64))
    return TailReads(per_source, joined, landing, clear)  # type: ignore[arg-type]
