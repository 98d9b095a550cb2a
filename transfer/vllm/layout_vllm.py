"""vLLM's KV cache as pdxfer geometry plus an `ExplicitLayout` over vLLM's own memory.

vLLM (0.32) backs every cache group with one allocation and hands the connector one view
per layer (`register_kv_caches`); `layout_places` checks each view against the geometry and
says where its heads and states sit (the views per layer kind are in its docstring).

The description below keeps, per cache tensor, byte offsets relative to its rank's memory
and the strides, independent of which heads the rank holds; `layout(rank)` then names the
heads. Everything a rank cannot describe (another KV layout, speculative conv slots, a
layer the geometry does not know) fails here, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transfer.cache.explicit_layout import ExplicitLayout
from transfer.cache.head_units import KVUnit, StateUnit, rank_units
from transfer.dataplane.regions import RegionMap
from transfer.errors import InvalidInput
from transfer.geometry import LayerKind, ModelGeometry, Role
from transfer.sizing import CacheDtypes
from transfer.vllm.layout_places import KVPlace, StatePlace, attention_places, linear_places


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
            places, block_size, eb = attention_places(layer, spec, view, region_map, tp, where)
            kv += places
            block_sizes.add(block_size)
            kv_bytes.add(eb)
        else:
            places, ssm_eb, conv_eb = linear_places(
                layer, spec, view, region_map, tp, conv_order, where
            )
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
