"""A reference for checking transfers byte for byte, independently of the packer.

`GlobalCache` is one request's whole cache as a TP=1 run would hold it, in raw element
bits. `shard` cuts it the way a TP run holds it, using only the geometry's shard
functions; `write_rank` / `read_rank` go through the layout's typed views. `apply_memcpy`
runs plans with plain slicing: gathers, then wire copies, then scatters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from transfer.cache.layout import Layout
from transfer.geometry import CacheTensor, ModelGeometry, Role
from transfer.packer.plan import TransferPlan
from transfer.packer.request import TransferRequest
from transfer.sizing import CacheDtypes

_INT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
Key = tuple[int, str]  # (layer index, tensor name)


@dataclass
class GlobalCache:
    """Raw bytes per tensor: KV `[tokens, channels, elem]`, SSM `[slots, channels, elem]`,
    conv `[slots, channels, steps, elem]`; channels are the segments concatenated."""

    geometry: ModelGeometry
    tensors: dict[Key, np.ndarray]

    @classmethod
    def random(
        cls,
        geometry: ModelGeometry,
        num_tokens: int,
        num_slots: int,
        dtypes: CacheDtypes,
        rng: np.random.Generator,
    ) -> GlobalCache:
        tensors = {}
        for layer in geometry.layers:
            for t in layer.cache_tensors():
                eb = dtypes.of(t.role)
                if t.role is Role.KV:
                    shape = (num_tokens, t.channels, eb)
                elif t.role is Role.SSM:
                    shape = (num_slots, t.channels, eb)
                else:
                    shape = (num_slots, t.channels, t.steps, eb)
                tensors[layer.index, t.name] = rng.integers(0, 256, shape, dtype=np.uint8)
        return cls(geometry, tensors)


def rank_channels(tensor: CacheTensor, tp: int, rank: int) -> np.ndarray:
    """Global channel indices a rank holds, in its channel order (per segment)."""
    picked, start = [], 0
    for segment in tensor.segments:
        units = segment.units_on_rank(tp, rank)
        first, last = units.start * segment.unit_elems, units.stop * segment.unit_elems
        picked.append(np.arange(start + first, start + last))
        start += segment.num_units * segment.unit_elems
    return np.concatenate(picked)


def shard(cache: GlobalCache, tp: int, rank: int) -> dict[Key, np.ndarray]:
    """What rank `rank` of a TP=`tp` run holds for the request."""
    out = {}
    for layer in cache.geometry.layers:
        for t in layer.cache_tensors():
            out[layer.index, t.name] = cache.tensors[layer.index, t.name][
                :, rank_channels(t, tp, rank)
            ]
    return out


def _typed(raw: np.ndarray) -> torch.Tensor:
    """uint8 [..., C, (steps,) elem] -> int tensor [..., C, (steps)] with the same bits."""
    eb = raw.shape[-1]
    flat = torch.from_numpy(np.ascontiguousarray(raw).reshape(*raw.shape[:-2], -1))
    return flat.view(_INT_DTYPES[eb]).reshape(raw.shape[:-1])


def _views(layout: Layout, arena: torch.Tensor):
    """(key, role, int view) for every tensor of the rank."""
    for layer in layout.geometry.layers:
        for t in layer.cache_tensors():
            dtype = _INT_DTYPES[layout.dtypes.of(t.role)]
            if t.role is Role.KV:
                view = layout.kv_view(arena, layer.index, t.name, dtype)
            elif t.role is Role.SSM:
                view = layout.ssm_view(arena, layer.index, dtype)
            else:
                view = layout.conv_view(arena, layer.index, t.name, dtype)
            yield (layer.index, t.name), t.role, view


def _token_index(layout: Layout, blocks: Sequence[int], num_tokens: int):
    t = torch.arange(num_tokens if layout.has_kv else 0)
    return torch.as_tensor(blocks, dtype=torch.long)[t // layout.block_size], t % layout.block_size


def write_rank(
    layout: Layout,
    arena: torch.Tensor,
    data: dict[Key, np.ndarray],
    blocks: Sequence[int],
    slots: Sequence[int],
    num_tokens: int,
) -> None:
    """Store a rank's shard (from `shard`) into its arena at the request's blocks and slots."""
    block_of, pos = _token_index(layout, blocks, num_tokens)
    slot_index = torch.as_tensor(slots, dtype=torch.long)
    for key, role, view in _views(layout, arena):
        if role is Role.KV:
            view[block_of, pos] = _typed(data[key]).reshape(num_tokens, *view.shape[2:])
        else:
            view[slot_index] = _typed(data[key]).reshape(len(slot_index), *view.shape[1:])


def read_rank(
    layout: Layout,
    arena: torch.Tensor,
    blocks: Sequence[int],
    slots: Sequence[int],
    num_tokens: int,
) -> dict[Key, np.ndarray]:
    """The request's bytes as the rank holds them, in `shard`'s shapes."""
    block_of, pos = _token_index(layout, blocks, num_tokens)
    slot_index = torch.as_tensor(slots, dtype=torch.long)
    out = {}
    for key, role, view in _views(layout, arena):
        if role is Role.KV:
            values = view[block_of, pos].reshape(num_tokens, -1)
        elif role is Role.SSM:
            values = view[slot_index].reshape(len(slot_index), -1)
        else:
            values = view[slot_index]
        raw = values.contiguous().numpy().view(np.uint8)
        out[key] = raw.reshape(*values.shape, values.element_size())
    return out


def request_mask(
    layout: Layout, blocks: Sequence[int], slots: Sequence[int], num_tokens: int
) -> np.ndarray:
    """bool [arena_bytes]: the bytes that hold the request on this rank."""
    mask = torch.zeros(layout.arena_bytes, dtype=torch.uint8)
    block_of, pos = _token_index(layout, blocks, num_tokens)
    slot_index = torch.as_tensor(slots, dtype=torch.long)
    for _, role, view in _views(layout, mask):
        if role is Role.KV:
            view[block_of, pos] = -1
        else:
            view[slot_index] = -1
    return mask.numpy() == 255


def apply_memcpy(
    plans: Sequence[TransferPlan],
    prefill_arenas: Sequence[np.ndarray],
    decode_arenas: Sequence[np.ndarray],
    steps: Sequence[str] = ("gather", "wire", "scatter"),
) -> None:
    """Run the plans on uint8 arrays: every gather, then every wire copy, then every scatter
    (or only the `steps` named, when another tool runs the rest)."""
    for step in steps:
        for plan in plans:
            for source in plan.sources:
                src = (
                    decode_arenas[plan.decode_rank]
                    if step == "scatter"
                    else prefill_arenas[source.prefill_rank]
                )
                dst = (
                    prefill_arenas[source.prefill_rank]
                    if step == "gather"
                    else decode_arenas[plan.decode_rank]
                )
                for s, d, n in getattr(source, step).entries():
                    dst[d : d + n] = src[s : s + n]


def _staging_mask(layout: Layout) -> np.ndarray:
    mask = np.zeros(layout.arena_bytes, dtype=bool)
    mask[layout.staging_offset : layout.staging_offset + layout.staging_bytes] = True
    return mask


def check_transfer(
    prefill: Sequence[Layout],
    decode: Sequence[Layout],
    request: TransferRequest,
    plans: Sequence[TransferPlan],
    rng: np.random.Generator,
    apply=apply_memcpy,
) -> list[str]:
    """Fill every prefill arena with what a TP=P run holds (from one random global cache,
    around random garbage), run `apply(plans, prefill_arenas, decode_arenas)`, and list
    every problem: a decode tensor that differs from what a TP=D run holds, or a byte
    outside the request (and outside staging areas) that changed on either side."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny index ops: worker threads only add contention
    try:
        return _check_transfer(prefill, decode, request, plans, rng, apply)
    finally:
        torch.set_num_threads(threads)


def _check_transfer(prefill, decode, request, plans, rng, apply) -> list[str]:
    geometry, n = prefill[0].geometry, request.num_tokens
    cache = GlobalCache.random(geometry, n, len(request.src_slots), prefill[0].dtypes, rng)
    p_arenas = [rng.integers(0, 256, p.arena_bytes, dtype=np.uint8) for p in prefill]
    for layout, arena in zip(prefill, p_arenas, strict=True):
        data = shard(cache, layout.tp, layout.rank)
        write_rank(layout, torch.from_numpy(arena), data, request.src_blocks, request.src_slots, n)
    d_arenas = [rng.integers(0, 256, d.arena_bytes, dtype=np.uint8) for d in decode]
    p_before = [a.copy() for a in p_arenas]
    d_before = [a.copy() for a in d_arenas]
    apply(plans, p_arenas, d_arenas)

    problems = []
    for layout, arena, before in zip(prefill, p_arenas, p_before, strict=True):
        changed = (arena != before) & ~_staging_mask(layout)
        if changed.any():
            problems.append(f"prefill rank {layout.rank}: {int(changed.sum())} bytes changed")
    for layout, arena, before in zip(decode, d_arenas, d_before, strict=True):
        got = read_rank(layout, torch.from_numpy(arena), request.dst_blocks, request.dst_slots, n)
        want = shard(cache, layout.tp, layout.rank)
        for key in want:
            if not np.array_equal(got[key], want[key]):
                bad = int((got[key] != want[key]).sum())
                problems.append(
                    f"decode rank {layout.rank}: layer {key[0]} {key[1]}: {bad} bytes differ"
                )
        owned = request_mask(layout, request.dst_blocks, request.dst_slots, n)
        changed = (arena != before) & ~owned & ~_staging_mask(layout)
        if changed.any():
            first = int(np.flatnonzero(changed)[0])
            problems.append(
                f"decode rank {layout.rank}: {int(changed.sum())} bytes outside the request "
                f"changed (first at offset {first})"
            )
    return problems
