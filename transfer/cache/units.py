"""Where each unit (head or group) of each cache tensor lives in one rank's arena.

`build_kv_units` and `build_state_units` are the only code that turns a layout choice into
byte offsets; `Layout` caches their result. Every unit is affine in its indices, so the
packer emits ranges with numpy arithmetic and the views are plain strided tensors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from transfer.geometry import CacheTensor, LayerSpec, ModelGeometry, Role
from transfer.memplan import StatePlacement
from transfer.sizing import CacheDtypes


class KVOrder(str, enum.Enum):
    """Axis order of the KV region (the innermost axis is always the head dim)."""

    HEAD_MAJOR = "head_major"  # [lane=local head][block][token][layer, k|v]: blocks-first per head
    BLOCKS_FIRST = "blocks_first"  # [block][layer, k|v][token][local head]
    LAYER_FIRST = "layer_first"  # [layer, k|v][block][token][local head] (vLLM-like)


class SSMOrder(str, enum.Enum):
    """Order of the recurrent states inside a per-request slot."""

    HEAD_MAJOR = "head_major"  # [local head][layer]: a decode rank's heads are one run
    LAYER_MAJOR = "layer_major"  # [layer][local head], each layer's S next to its conv


class ConvOrder(str, enum.Enum):
    CHANNELS_TIME = "channels_time"  # [channels][W-1]: a head's window is one run
    TIME_CHANNELS = "time_channels"  # [W-1][channels]


@dataclass(frozen=True)
class KVUnit:
    """One head of one KV tensor on this rank. Token `t` of block `b` spans `nbytes` from
    `base + b * block_stride + t * token_stride`."""

    layer: int  # LayerSpec.index
    tensor: str
    segment: int
    unit: int  # global head index
    nbytes: int
    base: int
    block_stride: int
    token_stride: int


@dataclass(frozen=True)
class StateUnit:
    """One head/group of one state tensor on this rank. Element `c`, conv step `k` of slot
    `s` is `elem_bytes` at `base + s * slot_stride + c * elem_stride + k * step_stride`.
    SSM units have `steps == 1` and `elems = head_k_dim * head_v_dim`."""

    layer: int
    tensor: str
    role: Role
    segment: int
    unit: int
    elems: int
    steps: int
    elem_bytes: int
    base: int
    slot_stride: int
    elem_stride: int
    step_stride: int

    @property
    def nbytes(self) -> int:
        return self.elems * self.steps * self.elem_bytes

    @property
    def is_contiguous(self) -> bool:
        """The unit's whole window is one run in channel-major element order."""
        return self.elem_stride == self.steps * self.elem_bytes and (
            self.steps == 1 or self.step_stride == self.elem_bytes
        )


def align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _rank_units(tensor: CacheTensor, tp: int, rank: int) -> list[tuple[int, int, int]]:
    """(segment, global unit, unit_elems) in the rank's channel order."""
    return [
        (s, unit, segment.unit_elems)
        for s, segment in enumerate(tensor.segments)
        for unit in segment.units_on_rank(tp, rank)
    ]


def _kv_tensors(geometry: ModelGeometry) -> list[tuple[LayerSpec, CacheTensor]]:
    return [
        (layer, tensor)
        for layer in geometry.attention_layers
        for tensor in layer.cache_tensors()
        if tensor.role is Role.KV
    ]


def build_kv_units(
    geometry: ModelGeometry,
    tp: int,
    rank: int,
    block_size: int,
    num_blocks: int,
    elem_bytes: int,
    order: KVOrder,
) -> tuple[tuple[KVUnit, ...], int]:
    """All KV units of the rank, and the bytes they span (from offset 0)."""
    tensors = [(layer, t, _rank_units(t, tp, rank)) for layer, t in _kv_tensors(geometry)]
    units: list[KVUnit] = []
    if order is KVOrder.HEAD_MAJOR:
        # Tensors with the same per-rank head shape form a class; lane j of a class holds
        # head j of each of its tensors, so a lane's token row is all layers' K and V of one
        # head. A decode rank's heads are then whole lanes or runs of lanes.
        classes: dict[tuple, list] = {}
        for entry in tensors:
            classes.setdefault(tuple(u[2] for u in entry[2]), []).append(entry)
        cursor = 0
        for shape, members in classes.items():
            for lane, unit_elems in enumerate(shape):
                row = len(members) * unit_elems * elem_bytes
                for i, (layer, tensor, rank_units) in enumerate(members):
                    segment, unit, _ = rank_units[lane]
                    units.append(
                        KVUnit(
                            layer.index,
                            tensor.name,
                            segment,
                            unit,
                            unit_elems * elem_bytes,
                            cursor + i * unit_elems * elem_bytes,
                            block_size * row,
                            row,
                        )
                    )
                cursor += num_blocks * block_size * row
        return tuple(units), cursor
    rows = [sum(u[2] for u in rank_units) * elem_bytes for _, _, rank_units in tensors]
    block_bytes = block_size * sum(rows)
    cursor = 0
    for (layer, tensor, rank_units), row in zip(tensors, rows, strict=True):
        within = 0
        for segment, unit, unit_elems in rank_units:
            if order is KVOrder.BLOCKS_FIRST:
                base, block_stride = cursor + within, block_bytes
            else:
                base, block_stride = cursor + within, block_size * row
            units.append(
                KVUnit(
                    layer.index,
                    tensor.name,
                    segment,
                    unit,
                    unit_elems * elem_bytes,
                    base,
                    block_stride,
                    row,
                )
            )
            within += unit_elems * elem_bytes
        cursor += (
            block_size * row if order is KVOrder.BLOCKS_FIRST else num_blocks * block_size * row
        )
    total = num_blocks * block_bytes if order is KVOrder.BLOCKS_FIRST else cursor
    return tuple(units), total


def _slot_tensors(
    layer: LayerSpec,
    tensors: list[CacheTensor],
    tp: int,
    rank: int,
    dtypes: CacheDtypes,
    conv_order: ConvOrder,
    start: int,
) -> tuple[list[tuple], int]:
    """Place `tensors` of one layer one after another from `start` (slot-relative)."""
    placed = []
    cursor = start
    for tensor in tensors:
        eb = dtypes.of(tensor.role)
        cursor = align(cursor, eb)
        channels = tensor.rank_channels(tp)
        time_major = tensor.role is Role.CONV and conv_order is ConvOrder.TIME_CHANNELS
        channel = 0
        for segment, unit, unit_elems in _rank_units(tensor, tp, rank):
            if time_major:
                offset, elem_stride, step_stride = channel * eb, eb, channels * eb
            else:
                offset, elem_stride, step_stride = (
                    channel * tensor.steps * eb,
                    tensor.steps * eb,
                    eb,
                )
            placed.append(
                (
                    layer,
                    tensor,
                    segment,
                    unit,
                    unit_elems,
                    eb,
                    cursor + offset,
                    elem_stride,
                    step_stride,
                )
            )
            channel += unit_elems
        cursor += channels * tensor.steps * eb
    return placed, cursor


def _ssm_lanes(
    layers: tuple[LayerSpec, ...], tp: int, rank: int, elem_bytes: int, start: int
) -> tuple[list[tuple], int]:
    """Recurrent states head-major: lane j is head j of every layer's S, one after another,
    so a decode rank's heads of all layers are one run per source (as for KV lanes)."""
    classes: dict[tuple, list] = {}
    for layer in layers:
        for tensor in layer.cache_tensors():
            if tensor.role is Role.SSM:
                rank_units = _rank_units(tensor, tp, rank)
                classes.setdefault(tuple(u[2] for u in rank_units), []).append(
                    (layer, tensor, rank_units)
                )
    placed = []
    cursor = align(start, elem_bytes)
    for shape, members in classes.items():
        for lane, unit_elems in enumerate(shape):
            for layer, tensor, rank_units in members:
                segment, unit, _ = rank_units[lane]
                placed.append(
                    (
                        layer,
                        tensor,
                        segment,
                        unit,
                        unit_elems,
                        elem_bytes,
                        cursor,
                        elem_bytes,
                        elem_bytes,
                    )
                )
                cursor += unit_elems * elem_bytes
    return placed, cursor


def build_state_units(
    geometry: ModelGeometry,
    tp: int,
    rank: int,
    num_slots: int,
    dtypes: CacheDtypes,
    placement: StatePlacement,
    conv_order: ConvOrder,
    ssm_order: SSMOrder,
) -> tuple[tuple[StateUnit, ...], int]:
    """All state units of the rank (offsets from the state region's start), and its size.

    Per request, head-major: `[slot][S lanes][layer][conv tensors]`; layer-major:
    `[slot][layer][S, conv tensors]`. Either way one slot is one run. Per layer:
    `[layer][slot][S, conv tensors]`. Tensors start aligned to their element size.
    """
    slot_align = max(dtypes.ssm, dtypes.conv)
    layers = geometry.linear_layers

    def units(placed: list, region: int, slot_stride: int) -> list[StateUnit]:
        return [
            StateUnit(
                layer.index,
                tensor.name,
                tensor.role,
                segment,
                unit,
                elems,
                tensor.steps,
                eb,
                region + offset,
                slot_stride,
                elem_stride,
                step_stride,
            )
            for layer, tensor, segment, unit, elems, eb, offset, elem_stride, step_stride in placed
        ]

    if placement is StatePlacement.PER_REQUEST:
        placed: list[tuple] = []
        cursor = 0
        head_major = ssm_order is SSMOrder.HEAD_MAJOR
        if head_major:
            placed, cursor = _ssm_lanes(layers, tp, rank, dtypes.ssm, 0)
        for layer in layers:
            tensors = [t for t in layer.cache_tensors() if not (head_major and t.role is Role.SSM)]
            more, cursor = _slot_tensors(layer, tensors, tp, rank, dtypes, conv_order, cursor)
            placed += more
        slot_bytes = align(cursor, slot_align)
        return tuple(units(placed, 0, slot_bytes)), num_slots * slot_bytes
    result: list[StateUnit] = []
    region = 0
    for layer in layers:
        placed, end = _slot_tensors(
            layer, list(layer.cache_tensors()), tp, rank, dtypes, conv_order, 0
        )
        slot_bytes = align(end, slot_align)
        result += units(placed, region, slot_bytes)
        region += num_slots * slot_bytes
    return tuple(result), region
