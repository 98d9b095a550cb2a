"""The naive comparison: one descriptor per (layer, block, K/V region), as vLLM's
NixlConnector posts, and one per (layer, state tensor, slot).

It emulates vLLM's memory, not ours: the vLLM-like layouts (`NAIVE_OPTIONS`: per-layer KV
regions, per-layer state slot arrays), with each block of a KV region in HND order
(`[block][local head][token][head_dim]`, the order vLLM uses for heterogeneous TP), so the
heads one prefill rank holds of one block are one contiguous run on both sides. The
region offsets come from the layout; only the order inside a block is HND here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from transfer.cache import Layout
from transfer.packer import TransferRequest, source_rank


def _segments(layout: Layout) -> dict:
    return {
        (layer.index, t.name): t.segments
        for layer in layout.geometry.layers
        for t in layer.cache_tensors()
    }


def _kv_pieces(prefill: Sequence[Layout], decode: Layout, request: TransferRequest, add) -> None:
    p_tp, bs = prefill[0].tp, decode.block_size
    blocks = len(request.dst_blocks)
    src_blocks = np.asarray(request.src_blocks, dtype=np.int64)
    dst_blocks = np.asarray(request.dst_blocks, dtype=np.int64)
    filled = np.full(blocks, bs, dtype=np.int64)
    filled[-1] = request.num_tokens - bs * (blocks - 1)
    segments = _segments(decode)
    tensors = sorted({(u.layer, u.tensor) for u in decode.kv_units()})
    for key, (layer, tensor) in enumerate(tensors):
        d_units = decode.tensor_kv_units(layer, tensor)
        for d_index, du in enumerate(d_units):
            p = source_rank(
                segments[layer, tensor][du.segment], du.unit, p_tp, decode.tp, decode.rank
            )
            p_units = prefill[p].tensor_kv_units(layer, tensor)
            p_index = next(
                i for i, u in enumerate(p_units) if (u.segment, u.unit) == (du.segment, du.unit)
            )
            # HND inside the layer-first block: head i's tokens start at i * bs * head bytes.
            src = p_units[0].base + src_blocks * p_units[0].block_stride + p_index * bs * du.nbytes
            dst = d_units[0].base + dst_blocks * d_units[0].block_stride + d_index * bs * du.nbytes
            group = (key * blocks + np.arange(blocks)) * prefill[0].tp + p
            add(p, group, src, dst, filled * du.nbytes)


def _state_pieces(prefill: Sequence[Layout], decode: Layout, request: TransferRequest, add) -> None:
    p_tp = prefill[0].tp
    src_slots = np.asarray(request.src_slots, dtype=np.int64)
    dst_slots = np.asarray(request.dst_slots, dtype=np.int64)
    segments = _segments(decode)
    tensors = sorted({(u.layer, u.tensor) for u in decode.state_units()})
    offset = 1 << 40  # state groups never merge with KV groups
    for key, (layer, tensor) in enumerate(tensors):
        for du in decode.tensor_state_units(layer, tensor):
            p = source_rank(
                segments[layer, tensor][du.segment], du.unit, p_tp, decode.tp, decode.rank
            )
            su = prefill[p].state_unit(layer, tensor, du.segment, du.unit)
            if not (su.is_contiguous and du.is_contiguous):
                raise ValueError(f"naive layout: state unit {layer}/{tensor} is not contiguous")
            src = su.base + src_slots * su.slot_stride
            dst = du.base + dst_slots * du.slot_stride
            group = offset + (key * len(dst_slots) + np.arange(len(dst_slots))) * p_tp + p
            add(p, group, src, dst, np.full(len(dst_slots), su.nbytes, dtype=np.int64))


def naive_ranges(
    prefill: Sequence[Layout], decode: Layout, request: TransferRequest
) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """Per source prefill rank: `(prefill_rank, src_offsets, dst_offsets, lengths)` of one
    decode rank's naive descriptors. `prefill`/`decode` are the vLLM-like layouts. Pieces
    merge only inside one (layer, block, region, source): one descriptor each, as vLLM."""
    by_source: dict[int, list[list[np.ndarray]]] = {}

    def add(p: int, group, src, dst, lengths) -> None:
        parts = by_source.setdefault(p, [[], [], [], []])
        for part, values in zip(parts, (group, src, dst, lengths), strict=True):
            part.append(np.asarray(values, dtype=np.int64))

    if decode.has_kv:
        _kv_pieces(prefill, decode, request, add)
    if decode.has_state:
        _state_pieces(prefill, decode, request, add)
    out = []
    for p in sorted(by_source):
        group, src, dst, lengths = (np.concatenate(part) for part in by_source[p])
        order = np.lexsort((dst, group))
        group, src, dst, lengths = group[order], src[order], dst[order], lengths[order]
        starts = np.ones(len(group), dtype=bool)
        starts[1:] = (
            (group[1:] != group[:-1])
            | (src[:-1] + lengths[:-1] != src[1:])
            | (dst[:-1] + lengths[:-1] != dst[1:])
        )
        first = np.flatnonzero(starts)
        out.append((p, src[first], dst[first], np.add.reduceat(lengths, first)))
    return out
