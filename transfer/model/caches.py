"""What the model reads and writes: typed views of one TP rank's caches.

The layers see caches only through `CacheAccess`, so the same model runs over the
transfer arena (`ArenaCaches`) and over plain tensors (`LocalCaches`, for tests). Views may be strided
(head-major arena); the layers only index, gather and `copy_` into them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from transfer.cache.arena import Arena
from transfer.geometry import LayerKind, LayerSpec, ModelGeometry, Role


@runtime_checkable
class CacheAccess(Protocol):
    """One rank's caches. `layer` is `LayerSpec.index` (the decoder-layer position).

    - `kv(layer, "k" | "v")` (GQA): `[num_blocks, block_size, rank_kv_heads, head_dim]`
    - `kv(layer, "kv")` (MLA, replicated): `[num_blocks, block_size, kv_lora_rank + rope_dim]`
    - `ssm(layer)`: `[num_slots, rank_heads, head_k_dim, head_v_dim]`, fp32
    - `conv(layer, name)`: `[num_slots, rank_channels, conv_kernel - 1]`; name "conv"
      (GDN: the rank's q|k|v channels, Mamba2: x|B|C) or "conv_q", "conv_k", "conv_v" (KDA)
    """

    block_size: int
    num_blocks: int
    num_slots: int

    def kv(self, layer: int, name: str) -> torch.Tensor: ...

    def ssm(self, layer: int) -> torch.Tensor: ...

    def conv(self, layer: int, name: str) -> torch.Tensor: ...


def view_shape(layer: LayerSpec, name: str, tp: int, rows: int, block_size: int) -> tuple:
    """The shape `CacheAccess` returns for tensor `name` of `layer` at TP degree `tp`.

    `rows` is num_blocks for KV tensors and num_slots for SSM/conv.
    """
    tensor = next((t for t in layer.cache_tensors() if t.name == name), None)
    if tensor is None:
        names = [t.name for t in layer.cache_tensors()]
        raise ValueError(
            f"name: layer {layer.index} ({layer.kind.value}) has {names}, not {name!r}"
        )
    spec = layer.spec
    if tensor.role is Role.KV:
        if layer.kind is LayerKind.MLA:
            return (rows, block_size, tensor.channels)
        (heads,) = tensor.segments
        return (rows, block_size, heads.units_per_rank(tp), heads.unit_elems)
    if tensor.role is Role.SSM:
        (heads,) = tensor.segments
        if layer.kind is LayerKind.GDN:
            k_dim, v_dim = spec.head_k_dim, spec.head_v_dim
        elif layer.kind is LayerKind.KDA:
            k_dim = v_dim = spec.head_dim
        else:
            k_dim, v_dim = spec.head_dim, spec.state_size
        return (rows, heads.units_per_rank(tp), k_dim, v_dim)
    return (rows, tensor.rank_channels(tp), tensor.steps)


class LocalCaches:
    """Plain per-tensor caches for one rank (no arena, no transport); `tensors` maps
    (layer index, tensor name) to each. KV and conv use `dtype`, SSM `ssm_dtype`."""

    def __init__(
        self,
        geometry: ModelGeometry,
        *,
        tp: int = 1,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        ssm_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for field, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{field} must be >= 1, got {value}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        geometry.check_tp(tp)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.tensors: dict[tuple[int, str], torch.Tensor] = {}
        for layer in geometry.layers:
            for tensor in layer.cache_tensors():
                rows = num_blocks if tensor.role is Role.KV else num_slots
                shape = view_shape(layer, tensor.name, tp, rows, block_size)
                state_dtype = ssm_dtype if tensor.role is Role.SSM else dtype
                self.tensors[layer.index, tensor.name] = torch.zeros(
                    shape, dtype=state_dtype, device=device
                )

    def kv(self, layer: int, name: str) -> torch.Tensor:
        return self._get(layer, name)

    def ssm(self, layer: int) -> torch.Tensor:
        return self._get(layer, "ssm")

    def conv(self, layer: int, name: str) -> torch.Tensor:
        return self._get(layer, name)

    def _get(self, layer: int, name: str) -> torch.Tensor:
        try:
            return self.tensors[layer, name]
        except KeyError:
            raise ValueError(f"no cache tensor {name!r} for layer {layer}") from None


class ArenaCaches:
    """`CacheAccess` over one rank's transfer arena: the layout's strided views, built once.

    Store fp32 (`CacheDtypes(4, 4, 4)`) for bit-exact transfers of the tiny models; other
    element sizes work too (the model computes in fp32 and casts on write).
    """

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.block_size = arena.layout.block_size
        self.num_blocks = arena.layout.num_blocks
        self.num_slots = arena.layout.num_slots
        self._views: dict[tuple[str, int, str], torch.Tensor] = {}

    def kv(self, layer: int, name: str) -> torch.Tensor:
        return self._view("kv", layer, name)

    def ssm(self, layer: int) -> torch.Tensor:
        return self._view("ssm", layer, "ssm")

    def conv(self, layer: int, name: str) -> torch.Tensor:
        return self._view("conv", layer, name)

    def _view(self, role: str, layer: int, name: str) -> torch.Tensor:
        key = (role, layer, name)
        if key not in self._views:
            if role == "kv":
                self._views[key] = self.arena.kv(layer, name)
            elif role == "ssm":
                self._views[key] = self.arena.ssm(layer)
            else:
                self._views[key] = self.arena.conv(layer, name)
        return self._views[key]
