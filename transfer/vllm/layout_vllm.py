"""vLLM's KV cache as pdxfer geometry plus an `ExplicitLayout` over vLLM's own memory.

vLLM (0.32) backs every cache group with one allocation and hands the connector one view
per layer (`register_kv_caches`):
- attention: `[blocks, kv_heads, block_size, head_size + head_size_v]` in the KV dtype
  (LBHNC: a head's part of a block is one run). The CPU kernel reads that run as K
  dim-major (`[head_size][block_size]`) then V token-major, so a token's K is not one run:
  the units below name the view's rows, and `load_plan` moves attention blocks whole;
- MLA: `[blocks, 1, block_size, kv_lora_rank + rope_dim]`;
- mamba-like (GDN, Mamba2): raw int8 pages `[blocks, 1, 1, page bytes]`; each page holds
  the layer's states back to back (`MambaSpec.shapes` / `dtypes`: conv, then SSM), and the
  page may be padded so that every group's pages are the same size.

The description below keeps, per cache tensor, byte offsets relative to its rank's memory
and the strides, independent of which heads the rank holds; `layout(rank)` then names the
heads. Everything a rank cannot describe (another KV layout, speculative conv slots, a
layer the geometry does not know) fails here, naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from transfer.cache.explicit_layout import ExplicitLayout
from transfer.cache.head_units import KVUnit, StateUnit, rank_units
from transfer.dataplane.regions import RegionMap
from transfer.errors import InvalidInput
from transfer.geometry import LayerKind, ModelGeometry, Role
from transfer.sizing import CacheDtypes

STATE_ORDER_SD = "SD"  # conv state per block: (state_len, dim), vLLM's default
STATE_ORDER_DS = "DS"  # (dim, state_len), VLLM_SSM_CONV_STATE_LAYOUT=DS


@dataclass(frozen=True)
class KVPlace:
    """One attention layer's cache tensor: local head `j` of block `b`, token `t` starts at
    `base + j * head_stride + b * block_stride + t * token_stride` (virtual bytes)."""

    layer: int
    tensor: str
    base: int
    head_stride: int
    block_stride: int
    token_stride: int
    nbytes: int  # one head's row of this tensor


@dataclass(frozen=True)
class StatePlace:
    """One linear layer's state tensor in its page: local channel `c` (conv) or head `c`
    (SSM), step `k` of slot `s` is at `base + s * slot_stride + c * elem_stride + k *
    step_stride` (virtual bytes; SSM: a head is one run of `unit_bytes`)."""

    layer: int
    tensor: str
    role: Role
    base: int
    slot_stride: int
    elem_stride: int
    step_stride: int
    elem_bytes: int


@dataclass(frozen=True)
class VllmMemory:
    """One rank's registered memory and where every cache tensor sits in it."""

    geometry: ModelGeometry
    tp: int
    block_size: int
    num_blocks: int
    dtypes: CacheDtypes
    region_map: RegionMap
    kv: tuple[KVPlace, ...]
    state: tuple[StatePlace, ...]
    engine: str

    def layout(self, rank: int) -> ExplicitLayout:
        """The layout of TP rank `rank` (every rank's memory has the same shape)."""
        tensors = {
            (layer.index, t.name): t
            for layer in self.geometry.layers
            for t in layer.cache_tensors()
        }
        kv_units = []
        for place in self.kv:
            held = rank_units(tensors[place.layer, place.tensor], self.tp, rank)
            for j, (segment, unit, _) in enumerate(held):
                kv_units.append(
                    KVUnit(
                        place.layer,
                        place.tensor,
                        segment,
                        unit,
                        place.nbytes,
                        place.base + j * place.head_stride,
                        place.block_stride,
                        place.token_stride,
                    )
                )
        state_units = []
        for place in self.state:
            tensor = tensors[place.layer, place.tensor]
            channel = 0
            for segment, unit, unit_elems in rank_units(tensor, self.tp, rank):
                if place.role is Role.SSM:
                    base = place.base + channel * place.elem_bytes
                    elem_stride = step_stride = place.elem_bytes
                else:
                    base = place.base + channel * place.elem_stride
                    elem_stride, step_stride = place.elem_stride, place.step_stride
                state_units.append(
                    StateUnit(
                        place.layer,
                        place.tensor,
                        place.role,
                        segment,
                        unit,
                        unit_elems,
                        tensor.steps,
                        place.elem_bytes,
                        base,
                        place.slot_stride,
                        elem_stride,
                        step_stride,
                    )
                )
                channel += unit_elems
        return ExplicitLayout(
            self.geometry,
            self.tp,
            rank,
            self.block_size,
            self.num_blocks,
            self.num_blocks,
            self.dtypes,
            kv=tuple(kv_units),
            state=tuple(state_units),
            extent=self.region_map.extent,
            engine=self.engine,
        )


def storage_regions(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The distinct allocations behind `tensors`, each as a uint8 tensor over all of it,
    in address order."""
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device)
            whole.set_(storage, 0, (storage.nbytes(),), (1,))
            seen[storage.data_ptr()] = whole
    return [seen[k] for k in sorted(seen)]


def _virtual(t: torch.Tensor, region_map: RegionMap) -> int:
    region = region_map.find_address(t.data_ptr())
    return region.start + t.data_ptr() - region.address


def _elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def describe(
    geometry: ModelGeometry,
    tp: int,
    layers: dict[int, tuple[object, torch.Tensor]],
    conv_order: str,
    engine: str,
) -> tuple[VllmMemory, list[torch.Tensor]]:
    """Describe one rank's caches. `layers`: model layer index -> (its vLLM KV cache spec,
    the view vLLM registered). Returns the description and the regions to register."""
    known = {layer.index: layer for layer in geometry.layers}
    missing = sorted(set(known) - set(layers))
    extra = sorted(set(layers) - set(known))
    if missing or extra:
        raise InvalidInput(
            f"vLLM caches: layers {extra} are not cache layers of {geometry.name!r}, and "
            f"its layers {missing} have no cache in vLLM"
        )
    regions = storage_regions([view for _, view in layers.values()])
    region_map = RegionMap.place([(r.data_ptr(), r.numel()) for r in regions])
    kv: list[KVPlace] = []
    state: list[StatePlace] = []
    block_sizes, blocks = set(), set()
    kv_bytes, ssm_bytes, conv_bytes = set(), set(), set()
    for index in sorted(layers):
        spec, view = layers[index]
        layer = known[index]
        where = f"layer {index} ({layer.spec.kind.value})"
        if layer.spec.kind in (LayerKind.GQA, LayerKind.MLA):
            places, block_size, eb = _attention(layer, spec, view, region_map, tp, where)
            kv += places
            block_sizes.add(block_size)
            kv_bytes.add(eb)
        else:
            places, ssm_eb, conv_eb = _linear(layer, spec, view, region_map, tp, conv_order, where)
            state += places
            ssm_bytes.add(ssm_eb)
            conv_bytes.add(conv_eb)
        blocks.add(view.shape[0])
    for name, values in (("block sizes", block_sizes), ("block counts", blocks)):
        if len(values) > 1:
            raise InvalidInput(f"vLLM caches: layers differ in {name} {sorted(values)}")
    for name, values in (("KV", kv_bytes), ("SSM", ssm_bytes), ("conv", conv_bytes)):
        if len(values) > 1:
            raise InvalidInput(f"vLLM caches: {name} element sizes differ {sorted(values)}")
    dtypes = CacheDtypes(
        kv=next(iter(kv_bytes), 2), ssm=next(iter(ssm_bytes), 2), conv=next(iter(conv_bytes), 2)
    )
    block_size = next(iter(block_sizes), 1)
    memory = VllmMemory(
        geometry,
        tp,
        block_size,
        blocks.pop(),
        dtypes,
        region_map,
        tuple(kv),
        tuple(state),
        f"{engine} conv={conv_order}",
    )
    return memory, regions


def _attention(layer, spec, view, region_map, tp, where) -> tuple[list[KVPlace], int, int]:
    if view.dim() != 4:
        raise InvalidInput(
            f"vLLM caches: {where}: expected a [B, H, N, C] view, got {tuple(view.shape)}"
        )
    blocks, heads, tokens, content = view.shape
    eb = view.element_size()
    b_stride, h_stride, n_stride, c_stride = (s * eb for s in view.stride())
    tensors = [t for t in layer.cache_tensors() if t.role is Role.KV]
    rank_heads = [sum(1 for _ in rank_units(t, tp, 0)) for t in tensors]
    if c_stride != eb:
        raise InvalidInput(
            f"vLLM caches: {where}: the head dim is not innermost (layout unsupported)"
        )
    base = _virtual(view, region_map)
    if layer.spec.kind is LayerKind.MLA:
        width = tensors[0].segments[0].unit_elems
        if (heads, content) != (1, width):
            raise InvalidInput(
                f"vLLM caches: {where}: expected [B, 1, N, {width}], got {tuple(view.shape)}"
            )
        return [KVPlace(layer.index, "kv", base, 0, b_stride, n_stride, width * eb)], tokens, eb
    head_dim = tensors[0].segments[0].unit_elems
    if heads != rank_heads[0] or content != 2 * head_dim:
        raise InvalidInput(
            f"vLLM caches: {where}: expected [B, {rank_heads[0]}, N, {2 * head_dim}] (K|V per "
            f"token), got {tuple(view.shape)}"
        )
    places = [
        KVPlace(
            layer.index, name, base + k * head_dim * eb, h_stride, b_stride, n_stride, head_dim * eb
        )
        for k, name in enumerate(("k", "v"))
    ]
    return places, tokens, eb


def _linear(
    layer, spec, view, region_map, tp, conv_order, where
) -> tuple[list[StatePlace], int, int]:
    shapes, dtypes = getattr(spec, "shapes", None), getattr(spec, "dtypes", None)
    tensors = layer.cache_tensors()
    if shapes is None or len(shapes) != 2 or len(tensors) != 2:
        raise InvalidInput(
            f"vLLM caches: {where}: expected a conv and an SSM state (MambaSpec), got {spec!r}"
        )
    ssm, conv = (next(t for t in tensors if t.role is role) for role in (Role.SSM, Role.CONV))
    conv_shape, ssm_shape = tuple(shapes[0]), tuple(shapes[1])
    conv_eb, ssm_eb = _elem_bytes(dtypes[0]), _elem_bytes(dtypes[1])
    channels, steps = conv.rank_channels(tp), conv.steps
    expected_conv = (steps, channels) if conv_order == STATE_ORDER_SD else (channels, steps)
    if conv_shape != expected_conv:
        raise InvalidInput(
            f"vLLM caches: {where}: conv state {conv_shape}, expected {expected_conv} "
            f"({conv_order}; speculative conv slots are not supported)"
        )
    if math.prod(ssm_shape) != ssm.rank_channels(tp):
        raise InvalidInput(
            f"vLLM caches: {where}: SSM state {ssm_shape} holds {math.prod(ssm_shape)} "
            f"elements, the geometry {ssm.rank_channels(tp)}"
        )
    if view.dim() != 4 or view.shape[1:3] != (1, 1) or view.element_size() != 1:
        raise InvalidInput(
            f"vLLM caches: {where}: expected raw int8 pages [B, 1, 1, C], got {tuple(view.shape)}"
        )
    page_stride = view.stride(0)
    conv_bytes = math.prod(conv_shape) * conv_eb
    if view.shape[3] < conv_bytes + math.prod(ssm_shape) * ssm_eb:
        raise InvalidInput(
            f"vLLM caches: {where}: page of {view.shape[3]} B is smaller than its states"
        )
    base = _virtual(view, region_map)
    if conv_order == STATE_ORDER_SD:
        conv_elem, conv_step = conv_eb, channels * conv_eb
    else:
        conv_elem, conv_step = steps * conv_eb, conv_eb
    return (
        [
            StatePlace(
                layer.index, conv.name, Role.CONV, base, page_stride, conv_elem, conv_step, conv_eb
            ),
            StatePlace(
                layer.index,
                ssm.name,
                Role.SSM,
                base + conv_bytes,
                page_stride,
                ssm_eb,
                ssm_eb,
                ssm_eb,
            ),
        ],
        ssm_eb,
        conv_eb,
    )
