"""Elementary copies for one decode rank: every byte it needs, from one chosen prefill rank.

Each unit (head or group) of each tensor the decode rank holds is matched to the same
global unit on a prefill rank that holds it, and the two layouts' affine offsets turn
token or slot indices into byte ranges. Coalescing happens later.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from transfer.cache.head_units import StateUnit
from transfer.cache.layout import Layout
from transfer.geometry import CacheTensor, Role, Segment
from transfer.packer.request import TransferRequest


def source_rank(
    segment: Segment, unit: int, prefill_tp: int, decode_tp: int, decode_rank: int
) -> int:
    """The prefill rank decode rank `decode_rank` reads global `unit` of `segment` from.

    One holder unless the unit is replicated (MLA latent, GQA heads or Mamba2 groups when
    units < tp). Then prefer the prefill rank at the same relative position (at P = D it is
    the same rank; every unit of a decode rank tends to come from one source), else spread
    over the holders by decode rank. Either way the reads spread evenly over prefill ranks.
    """
    holders = segment.ranks_holding(unit, prefill_tp)
    natural = decode_rank * prefill_tp // decode_tp
    return natural if natural in holders else holders[decode_rank % len(holders)]


@dataclass
class SourcePieces:
    """Unsorted elementary copies from one prefill rank."""

    src: list[np.ndarray] = field(default_factory=list)
    dst: list[np.ndarray] = field(default_factory=list)
    lengths: list[np.ndarray] = field(default_factory=list)
    kv_bytes: int = 0
    state_bytes: int = 0

    def add(self, src: np.ndarray, dst: np.ndarray, length: int, is_kv: bool) -> None:
        """Copies of `length` bytes from each `src` to the matching `dst` (any shape)."""
        src, dst = np.ravel(src), np.ravel(dst)
        if is_kv:
            self.kv_bytes += src.size * length
        else:
            self.state_bytes += src.size * length
        # Merge neighbours in index order now (tokens of a block, steps of a window): the
        # global sort and coalesce later then see a few ranges per unit, not one per token.
        runs = np.ones(src.size, dtype=bool)
        runs[1:] = (src[:-1] + length != src[1:]) | (dst[:-1] + length != dst[1:])
        first = np.flatnonzero(runs)
        self.src.append(src[first])
        self.dst.append(dst[first])
        self.lengths.append(np.diff(np.append(first, src.size)) * length)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return tuple(np.concatenate(x) for x in (self.src, self.dst, self.lengths))


def _tensors(layout: Layout) -> dict[tuple[int, str], CacheTensor]:
    return {
        (layer.index, t.name): t for layer in layout.geometry.layers for t in layer.cache_tensors()
    }


def _token_blocks(
    request: TransferRequest, src: Layout, dst: Layout, tokens: tuple[int, int] | None
) -> tuple[np.ndarray, ...]:
    start, end = tokens or (0, request.num_tokens)
    t = np.arange(start, end, dtype=np.int64)
    src_blocks = np.asarray(request.src_blocks, dtype=np.int64)
    dst_blocks = np.asarray(request.dst_blocks, dtype=np.int64)
    return (
        src_blocks[t // src.block_size],
        t % src.block_size,
        dst_blocks[t // dst.block_size],
        t % dst.block_size,
    )


def _state_offsets(su: StateUnit, du: StateUnit, src_slots: np.ndarray, dst_slots: np.ndarray):
    """(src offsets, dst offsets, length) copying a unit that is not one run on both sides,
    for every slot pair."""
    src = su.base + src_slots * su.slot_stride
    dst = du.base + dst_slots * du.slot_stride
    steps = np.arange(su.steps, dtype=np.int64)
    if su.elem_stride == su.elem_bytes and du.elem_stride == du.elem_bytes:
        # Both time-major: each step's channels are one run on both sides.
        src = src[:, None] + steps * su.step_stride
        dst = dst[:, None] + steps * du.step_stride
        return src, dst, su.elems * su.elem_bytes
    # Different conv orders: a transpose, element by element (staging batches these).
    elems = np.arange(su.elems, dtype=np.int64)[:, None]
    src = src[:, None, None] + elems * su.elem_stride + steps * su.step_stride
    dst = dst[:, None, None] + elems * du.elem_stride + steps * du.step_stride
    return src, dst, su.elem_bytes


def _merge_runs(pairs: list[tuple]) -> list[tuple]:
    """Merge units that sit next to each other on both sides and share strides.

    `pairs` holds (strides key, src base, dst base, nbytes); returns the same, merged, so
    a lane of heads (all layers' K and V of one head, say) becomes one unit."""
    groups: dict[tuple, list] = defaultdict(list)
    for key, src, dst, nbytes in pairs:
        groups[key].append((dst, src, nbytes))
    merged = []
    for key, items in groups.items():
        items.sort()
        runs: list[list[int]] = []
        for dst, src, nbytes in items:
            last = runs[-1] if runs else None
            if last and last[0] + last[2] == dst and last[1] + last[2] == src:
                last[2] += nbytes
            else:
                runs.append([dst, src, nbytes])
        merged += [(key, src, dst, nbytes) for dst, src, nbytes in runs]
    return merged


def decode_rank_pieces(
    prefill: tuple[Layout, ...],
    decode: Layout,
    request: TransferRequest,
    layers: frozenset[int] | None = None,
    tokens: tuple[int, int] | None = None,
    with_state: bool = True,
) -> tuple[dict[int, SourcePieces], int]:
    """Elementary copies per source prefill rank for `decode`, and the naive descriptor
    count (one per layer x block x K/V region, or per state tensor x slot, per source).
    `layers` (model layer indices; None: all) limits both to those layers' caches,
    `tokens` (`[start, end)`; None: all) the KV to those tokens, and `with_state=False`
    leaves the state out (the naive count stays the whole request's)."""
    p_tp, d_tp, d_rank = prefill[0].tp, decode.tp, decode.rank
    tensors = _tensors(decode)
    by_source: dict[int, SourcePieces] = defaultdict(SourcePieces)
    sources_of: dict[tuple[int, str], set[int]] = defaultdict(set)

    def source_of(du) -> int:
        segment = tensors[du.layer, du.tensor].segments[du.segment]
        p = source_rank(segment, du.unit, p_tp, d_tp, d_rank)
        sources_of[du.layer, du.tensor].add(p)
        return p

    def wanted(units):
        return units if layers is None else [u for u in units if u.layer in layers]

    kv_pairs = []
    for du in wanted(decode.kv_units()):
        p = source_of(du)
        su = prefill[p].kv_unit(du.layer, du.tensor, du.segment, du.unit)
        key = (p, su.block_stride, su.token_stride, du.block_stride, du.token_stride)
        kv_pairs.append((key, su.base, du.base, su.nbytes))
    if kv_pairs and (tokens is None or tokens[1] > tokens[0]):
        src_block, src_pos, dst_block, dst_pos = _token_blocks(request, prefill[0], decode, tokens)
        for (p, s_block, s_token, d_block, d_token), src, dst, nbytes in _merge_runs(kv_pairs):
            by_source[p].add(
                src + src_block * s_block + src_pos * s_token,
                dst + dst_block * d_block + dst_pos * d_token,
                nbytes,
                is_kv=True,
            )

    src_slots = np.asarray(request.src_slots, dtype=np.int64)
    dst_slots = np.asarray(request.dst_slots, dtype=np.int64)
    whole_units = []
    for du in wanted(decode.state_units()) if with_state else ():
        p = source_of(du)
        su = prefill[p].state_unit(du.layer, du.tensor, du.segment, du.unit)
        if su.is_contiguous and du.is_contiguous:
            whole_units.append(((p, su.slot_stride, du.slot_stride), su.base, du.base, su.nbytes))
        else:
            src, dst, length = _state_offsets(su, du, src_slots, dst_slots)
            by_source[p].add(src, dst, length, is_kv=False)
    for (p, s_slot, d_slot), src, dst, nbytes in _merge_runs(whole_units):
        by_source[p].add(src + src_slots * s_slot, dst + dst_slots * d_slot, nbytes, is_kv=False)

    naive = 0
    for (layer, name), sources in sources_of.items():
        rows = len(request.dst_blocks) if tensors[layer, name].role is Role.KV else len(dst_slots)
        naive += rows * len(sources)
    return dict(sorted(by_source.items())), naive
