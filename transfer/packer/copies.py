"""What one decode rank reads for any request: every byte it needs, from one chosen
prefill rank, as copies affine in a token's block and position, or in a slot.

Each unit (head or group) of each tensor the decode rank holds is matched to the same
global unit on a prefill rank that holds it; units next to each other on both sides
merge. This depends only on the layouts (`pairs.InstancePair` caches it); per request,
`pieces.request_pieces` turns it into byte ranges with numpy arithmetic.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from transfer.cache.head_units import StateUnit
from transfer.cache.layout import Layout
from transfer.geometry import Role, Segment


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


def _frozen(values: list[int], shape: tuple[int, int]) -> np.ndarray:
    """Read-only int64 (it is cached), shaped to broadcast against a request's indices."""
    array = np.array(values, dtype=np.int64).reshape(shape)
    array.flags.writeable = False
    return array


@dataclass(frozen=True, eq=False)
class SourceCopies:
    """What a decode rank reads from prefill rank `rank`, for any request.

    KV copy i of a token: `kv_nbytes[i]` from `kv_src[i] + its src block *
    kv_src_block[i] + its position in the block * kv_src_token[i]`, to the same on the
    decode side. State copy j of a slot pair (s, d): `state_nbytes[j]` from
    `state_src[j] + s * state_src_slot[j]` to `state_dst[j] + d * state_dst_slot[j]`.
    KV fields are columns and state fields rows, so that a request expands the KV unit by
    unit ([copy, token]) and the state slot by slot ([slot, copy]).
    """

    rank: int
    kv_src: np.ndarray
    kv_dst: np.ndarray
    kv_nbytes: np.ndarray
    kv_src_block: np.ndarray
    kv_src_token: np.ndarray
    kv_dst_block: np.ndarray
    kv_dst_token: np.ndarray
    state_src: np.ndarray
    state_dst: np.ndarray
    state_nbytes: np.ndarray
    state_src_slot: np.ndarray
    state_dst_slot: np.ndarray
    kv_bytes_per_token: int
    state_bytes_per_slot: int


@dataclass(frozen=True, eq=False)
class RankCopies:
    """What one decode rank reads, for any request: copies per source, by prefill rank, and
    per tensor the number of sources (the naive count posts one descriptor per row and
    source). `kv_bytes_per_token` / `state_bytes_per_slot` are its planned units' sizes."""

    sources: tuple[SourceCopies, ...]
    kv_tensor_sources: int
    state_tensor_sources: int
    kv_bytes_per_token: int
    state_bytes_per_slot: int


def _state_offsets(su: StateUnit, du: StateUnit) -> tuple[np.ndarray, np.ndarray, int]:
    """(src offsets, dst offsets, length) in slot 0 copying a unit that is not one run on
    both sides."""
    steps = np.arange(su.steps, dtype=np.int64)
    if su.elem_stride == su.elem_bytes and du.elem_stride == du.elem_bytes:
        # Both time-major: each step's channels are one run on both sides.
        src = su.base + steps * su.step_stride
        dst = du.base + steps * du.step_stride
        return src, dst, su.elems * su.elem_bytes
    # Different conv orders: a transpose, element by element (staging batches these).
    elems = np.arange(su.elems, dtype=np.int64)[:, None]
    src = su.base + elems * su.elem_stride + steps * su.step_stride
    dst = du.base + elems * du.elem_stride + steps * du.step_stride
    return src.ravel(), dst.ravel(), su.elem_bytes


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


def rank_copies(
    prefill: tuple[Layout, ...], decode: Layout, layers: frozenset[int] | None, with_state: bool
) -> RankCopies:
    """What `decode` reads from the (valid) `prefill` instance for any request. `layers`
    (model layer indices; None: all) limits it to those layers' caches, and
    `with_state=False` leaves the state out."""
    p_tp, d_tp, d_rank = prefill[0].tp, decode.tp, decode.rank
    tensors = {
        (layer.index, t.name): t for layer in decode.geometry.layers for t in layer.cache_tensors()
    }
    sources_of: dict[tuple[int, str], set[int]] = defaultdict(set)

    def source_of(du) -> int:
        segment = tensors[du.layer, du.tensor].segments[du.segment]
        p = source_rank(segment, du.unit, p_tp, d_tp, d_rank)
        sources_of[du.layer, du.tensor].add(p)
        return p

    def wanted(units):
        return units if layers is None else [u for u in units if u.layer in layers]

    kv_units, state_units = wanted(decode.kv_units()), wanted(decode.state_units())
    kv_pairs = []
    for du in kv_units:
        p = source_of(du)
        su = prefill[p].kv_unit(du.layer, du.tensor, du.segment, du.unit)
        key = (p, su.block_stride, su.token_stride, du.block_stride, du.token_stride)
        kv_pairs.append((key, su.base, du.base, su.nbytes))
    # KV rows: (src, dst, nbytes, src block, src token, dst block, dst token strides).
    kv_rows: dict[int, list[tuple]] = defaultdict(list)
    for (p, *strides), src, dst, nbytes in _merge_runs(kv_pairs):
        kv_rows[p].append((src, dst, nbytes, *strides))

    # State rows: (src, dst, nbytes, src slot, dst slot strides); offsets in slot 0.
    state_rows: dict[int, list[tuple]] = defaultdict(list)
    whole_units = []
    for du in state_units if with_state else ():
        p = source_of(du)
        su = prefill[p].state_unit(du.layer, du.tensor, du.segment, du.unit)
        if su.is_contiguous and du.is_contiguous:
            whole_units.append(((p, su.slot_stride, du.slot_stride), su.base, du.base, su.nbytes))
        else:
            src, dst, length = _state_offsets(su, du)
            state_rows[p] += [
                (s, d, length, su.slot_stride, du.slot_stride)
                for s, d in zip(src.tolist(), dst.tolist(), strict=True)
            ]
    for (p, s_slot, d_slot), src, dst, nbytes in _merge_runs(whole_units):
        state_rows[p].append((src, dst, nbytes, s_slot, d_slot))

    def fields(rows: list[tuple], width: int, shape: tuple[int, int]) -> list[np.ndarray]:
        return [_frozen(list(f), shape) for f in zip(*rows, strict=True)] or [
            _frozen([], shape) for _ in range(width)
        ]

    sources = tuple(
        SourceCopies(
            p,
            *fields(kv_rows[p], 7, (-1, 1)),
            *fields(state_rows[p], 5, (1, -1)),
            sum(row[2] for row in kv_rows[p]),
            sum(row[2] for row in state_rows[p]),
        )
        for p in sorted(kv_rows.keys() | state_rows.keys())
    )
    kv_sources = sum(len(ps) for key, ps in sources_of.items() if tensors[key].role is Role.KV)
    return RankCopies(
        sources,
        kv_sources,
        sum(len(ps) for ps in sources_of.values()) - kv_sources,
        sum(u.nbytes for u in kv_units),
        sum(u.nbytes for u in state_units),
    )
