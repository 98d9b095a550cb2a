"""The served model and vLLM's KV caches in pdxfer's terms, read once at the worker's start-up.

vLLM names a cache by its layer's module path and groups layers by cache spec; pdxfer wants
layer indices, each group's layers and kind (`CacheGroup`), and the model's geometry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, UniformTypeKVCacheSpecs

from transfer.errors import InvalidInput
from transfer.geometry import ModelGeometry
from transfer.hf_geometry import from_hf_config, from_hf_dict
from transfer.vllm.layout_places import STATE_ORDER_DS, STATE_ORDER_SD
from transfer.vllm.load_plan import CacheGroup


def model_geometry(vllm_config: Any) -> ModelGeometry:
    """pdxfer geometry of the served model: its config.json, else vLLM's hf config."""
    model = Path(str(vllm_config.model_config.model))
    if (model / "config.json").is_file():
        return from_hf_config(model)
    hf = vllm_config.model_config.hf_config.to_dict()
    return from_hf_dict(hf, str(vllm_config.model_config.model))


def layer_index(name: str) -> int:
    """The model layer a vLLM cache name (a module path) belongs to."""
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


def conv_order() -> str:
    """How this vLLM build lays out a mamba conv state (`layout_places`' STATE_ORDER_*)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return STATE_ORDER_DS if is_conv_state_dim_first() else STATE_ORDER_SD


def cache_groups(kv_cache_config: Any) -> tuple[CacheGroup, ...]:
    """vLLM's transfer groups: each one's layers, and whether it pages tokens."""
    groups = []
    for group in kv_cache_config.transfer_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        if not isinstance(spec, AttentionSpec | MambaSpec):
            raise InvalidInput(f"vLLM caches: group of {type(spec).__name__} is not supported")
        layers = frozenset(layer_index(n) for n in group.layer_names)
        groups.append(CacheGroup(layers, isinstance(spec, AttentionSpec)))
    return tuple(groups)


def layer_specs(kv_cache_config: Any) -> dict[str, Any]:
    """Each cached layer's own spec, by vLLM's layer name."""
    specs = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            if isinstance(spec, UniformTypeKVCacheSpecs):
                specs[name] = spec.kv_cache_specs[name]
            else:
                specs[name] = spec
    return specs


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))
