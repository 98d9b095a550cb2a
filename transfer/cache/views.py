"""Typed, strided torch views of one rank's arena, as the engine's kernels index them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from transfer.errors import InvalidInput
from transfer.geometry import LayerKind, Role

if TYPE_CHECKING:
    from transfer.cache.layout import Layout

TORCH_DTYPES = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def torch_dtype(elem_bytes: int, override: torch.dtype | None = None) -> torch.dtype:
    """The element dtype for a size in bytes (bf16 for 2, fp32 for 4), or `override`."""
    if override is None:
        return TORCH_DTYPES[elem_bytes]
    if override.itemsize != elem_bytes:
        raise InvalidInput(
            f"dtype {override} is {override.itemsize} B, the cache stores {elem_bytes} B"
        )
    return override


def check_arena(layout: Layout, arena: torch.Tensor) -> torch.Tensor:
    if arena.dtype != torch.uint8 or arena.dim() != 1:
        raise InvalidInput(
            f"arena must be a 1-D uint8 tensor, got {arena.dtype} {tuple(arena.shape)}"
        )
    if arena.numel() < layout.arena_bytes:
        raise InvalidInput(f"arena has {arena.numel()} B, the layout needs {layout.arena_bytes} B")
    return arena[: layout.arena_bytes]


def _strided(
    arena: torch.Tensor, base: int, elem_bytes: int, shape: tuple, strides: Sequence[int], dtype
) -> torch.Tensor:
    typed = arena.view(torch_dtype(elem_bytes, dtype))
    for value in (base, *strides):
        assert value % elem_bytes == 0, "layout offsets are aligned to the element size"
    return typed.as_strided(
        shape, [s // elem_bytes for s in strides], typed.storage_offset() + base // elem_bytes
    )


def _spacing(bases: Sequence[int], what: str) -> int:
    steps = {b - a for a, b in zip(bases, bases[1:], strict=False)}
    if len(steps) > 1:
        raise InvalidInput(f"{what}: heads are not evenly spaced in this layout")
    return steps.pop() if steps else 0


def _layer(layout: Layout, layer: int):
    for spec in layout.geometry.layers:
        if spec.index == layer:
            return spec
    raise InvalidInput(f"layer {layer}: no cache-bearing layer with that index")


def kv_view(
    layout: Layout, arena: torch.Tensor, layer: int, tensor: str, dtype=None
) -> torch.Tensor:
    arena = check_arena(layout, arena)
    spec = _layer(layout, layer)
    units = layout.tensor_kv_units(layer, tensor)
    if not units:
        raise InvalidInput(f"layer {layer} ({spec.kind.value}) has no KV tensor {tensor!r}")
    first = units[0]
    if any(
        (u.block_stride, u.token_stride, u.nbytes)
        != (first.block_stride, first.token_stride, first.nbytes)
        for u in units
    ):
        raise InvalidInput(f"layer {layer} {tensor}: heads differ in shape")
    eb = layout.dtypes.kv
    spacing = _spacing([u.base for u in units], f"layer {layer} {tensor}")
    shape = (layout.num_blocks, layout.block_size, len(units), first.nbytes // eb)
    strides = (first.block_stride, first.token_stride, spacing or first.nbytes, eb)
    view = _strided(arena, first.base, eb, shape, strides, dtype)
    return view[:, :, 0] if spec.kind is LayerKind.MLA else view


def ssm_view(layout: Layout, arena: torch.Tensor, layer: int, dtype=None) -> torch.Tensor:
    arena = check_arena(layout, arena)
    spec = _layer(layout, layer)
    units = layout.tensor_state_units(layer, "ssm")
    if not units:
        raise InvalidInput(f"layer {layer} ({spec.kind.value}) has no recurrent state")
    kind_spec = spec.spec
    if spec.kind is LayerKind.GDN:
        k_dim, v_dim = kind_spec.head_k_dim, kind_spec.head_v_dim
    elif spec.kind is LayerKind.KDA:
        k_dim = v_dim = kind_spec.head_dim
    else:
        k_dim, v_dim = kind_spec.head_dim, kind_spec.state_size
    first = units[0]
    eb = first.elem_bytes
    spacing = _spacing([u.base for u in units], f"layer {layer} ssm")
    shape = (layout.num_slots, len(units), k_dim, v_dim)
    strides = (first.slot_stride, spacing or first.nbytes, v_dim * eb, eb)
    return _strided(arena, first.base, eb, shape, strides, dtype)


def conv_view(
    layout: Layout, arena: torch.Tensor, layer: int, tensor: str, dtype=None
) -> torch.Tensor:
    arena = check_arena(layout, arena)
    spec = _layer(layout, layer)
    units = layout.tensor_state_units(layer, tensor)
    if not units or units[0].role is not Role.CONV:
        raise InvalidInput(f"layer {layer} ({spec.kind.value}) has no conv state {tensor!r}")
    first = units[0]
    channels = sum(u.elems for u in units)
    shape = (layout.num_slots, channels, first.steps)
    strides = (first.slot_stride, first.elem_stride, first.step_stride)
    return _strided(arena, first.base, first.elem_bytes, shape, strides, dtype)
