"""Where each head/group of each linear layer's state (S and conv) lives in a state slot."""

from __future__ import annotations

from transfer.cache.head_units import (
    ConvOrder,
    SSMOrder,
    StateUnit,
    align,
    layer_group_of,
    rank_units,
)
from transfer.geometry import CacheTensor, LayerSpec, ModelGeometry, Role
from transfer.memplan import StatePlacement
from transfer.sizing import CacheDtypes


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
        for segment, unit, unit_elems in rank_units(tensor, tp, rank):
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
                held = rank_units(tensor, tp, rank)
                classes.setdefault(tuple(u[2] for u in held), []).append((layer, tensor, held))
    placed = []
    cursor = align(start, elem_bytes)
    for shape, members in classes.items():
        for lane, unit_elems in enumerate(shape):
            for layer, tensor, held in members:
                segment, unit, _ = held[lane]
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
    layer_group: int = 0,
) -> tuple[tuple[StateUnit, ...], int]:
    """All state units of the rank (offsets from the state region's start), and its size.

    Per request, head-major: `[slot][S lanes][layer][conv tensors]`; layer-major:
    `[slot][layer][S, conv tensors]`. Either way one slot is one run, and with streaming
    groups (`layer_group`) one run per group: head-major is then
    `[slot][group][its S lanes][its layers][conv tensors]`. Per layer:
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
        groups: dict[int, list[LayerSpec]] = {}
        for layer in layers:
            groups.setdefault(layer_group_of(layer.index, layer_group), []).append(layer)
        for members in groups.values():
            if head_major:
                lanes, cursor = _ssm_lanes(tuple(members), tp, rank, dtypes.ssm, cursor)
                placed += lanes
            for layer in members:
                tensors = [
                    t for t in layer.cache_tensors() if not (head_major and t.role is Role.SSM)
                ]
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
