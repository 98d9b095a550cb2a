"""Where each unit (head or group) of each cache tensor lives in one rank's arena.

`build_kv_units` and `state_units.build_state_units` are the only code that turns a layout choice into
byte offsets; `Layout` caches their result. Every unit is affine in its indices, so the
packer emits ranges with numpy arithmetic and the views are plain strided tensors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from transfer.errors import InvalidInput
from transfer.geometry import CacheTensor, LayerSpec, ModelGeometry, Role
from transfer.memplan import StatePlacement


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
class LayoutOptions:
    """Defaults are the transfer-friendly choices (docs/packer.md)."""

    kv_order: KVOrder = KVOrder.HEAD_MAJOR
    state_placement: StatePlacement = StatePlacement.PER_REQUEST
    conv_order: ConvOrder = ConvOrder.CHANNELS_TIME
    ssm_order: SSMOrder = SSMOrder.HEAD_MAJOR  # per-request placement only
    # Layers per streaming group (0: one group). Head-major lanes and per-request state
    # are laid out group by group, so each group's bytes are runs of their own: a group
    # crosses as soon as its layers are final (layer-wise streaming), at the price of one
    # range per group where one group would need one.
    layer_group: int = 0

    def __post_init__(self) -> None:
        if (
            isinstance(self.layer_group, bool)
            or not isinstance(self.layer_group, int)
            or self.layer_group < 0
        ):
            raise InvalidInput(
                f"options.layer_group: must be an integer >= 0, got {self.layer_group!r}"
            )
        for field, enum_type in (
            ("kv_order", KVOrder),
            ("state_placement", StatePlacement),
            ("conv_order", ConvOrder),
            ("ssm_order", SSMOrder),
        ):
            value = getattr(self, field)
            try:
                object.__setattr__(self, field, enum_type(value))
            except ValueError:
                choices = ", ".join(e.value for e in enum_type)
                raise InvalidInput(f"options.{field}: {value!r} is not one of {choices}") from None


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


def layer_group_of(layer_index: int, layer_group: int) -> int:
    """The streaming group of model layer `layer_index` (`LayoutOptions.layer_group`)."""
    return layer_index // layer_group if layer_group else 0


def align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def rank_units(tensor: CacheTensor, tp: int, rank: int) -> list[tuple[int, int, int]]:
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
    layer_group: int = 0,
) -> tuple[tuple[KVUnit, ...], int]:
    """All KV units of the rank, and the bytes they span (from offset 0)."""
    tensors = [(layer, t, rank_units(t, tp, rank)) for layer, t in _kv_tensors(geometry)]
    units: list[KVUnit] = []
    if order is KVOrder.HEAD_MAJOR:
        # Tensors with the same per-rank head shape (and streaming group) form a class;
        # lane j of a class holds head j of each of its tensors, so a lane's token row is
        # all its layers' K and V of one head. A decode rank's heads are then whole lanes
        # or runs of lanes.
        classes: dict[tuple, list] = {}
        for entry in tensors:
            group = layer_group_of(entry[0].index, layer_group)
            classes.setdefault((group, tuple(u[2] for u in entry[2])), []).append(entry)
        cursor = 0
        for (_, shape), members in classes.items():
            for lane, unit_elems in enumerate(shape):
                row = len(members) * unit_elems * elem_bytes
                for i, (layer, tensor, held) in enumerate(members):
                    segment, unit, _ = held[lane]
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
    rows = [sum(u[2] for u in held) * elem_bytes for _, _, held in tensors]
    block_bytes = block_size * sum(rows)
    cursor = 0  # where the tensor starts: inside block 0 (blocks-first) or in the region
    for (layer, tensor, held), row in zip(tensors, rows, strict=True):
        block_stride = block_bytes if order is KVOrder.BLOCKS_FIRST else block_size * row
        base = cursor
        for segment, unit, unit_elems in held:
            nbytes = unit_elems * elem_bytes
            units.append(
                KVUnit(layer.index, tensor.name, segment, unit, nbytes, base, block_stride, row)
            )
            base += nbytes
        cursor += block_size * row * (1 if order is KVOrder.BLOCKS_FIRST else num_blocks)
    return tuple(units), num_blocks * block_bytes
