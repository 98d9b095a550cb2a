"""Geometry <-> JSON-able dict, and a stable hash of it for the control-plane handshake."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from transfer.cache.head_units import LayoutOptions
from transfer.errors import InvalidInput
from transfer.geometry import (
    GDNSpec,
    GQASpec,
    KDASpec,
    LayerKind,
    LayerSpec,
    Mamba2Spec,
    MLASpec,
    ModelGeometry,
    canonical_dtype,
)
from transfer.sizing import CacheDtypes

_SPECS = {
    LayerKind.GQA: GQASpec,
    LayerKind.MLA: MLASpec,
    LayerKind.GDN: GDNSpec,
    LayerKind.KDA: KDASpec,
    LayerKind.MAMBA2: Mamba2Spec,
}


def geometry_to_dict(geometry: ModelGeometry) -> dict[str, Any]:
    layers = [
        {"index": layer.index, "kind": layer.kind.value, **dataclasses.asdict(layer.spec)}
        for layer in geometry.layers
    ]
    return {
        "name": geometry.name,
        "hidden_size": geometry.hidden_size,
        "vocab_size": geometry.vocab_size,
        "num_hidden_layers": geometry.num_hidden_layers,
        "dtype": geometry.dtype,
        "ssm_dtype": geometry.ssm_dtype,
        "layers": layers,
    }


def geometry_from_dict(data: Any, field: str = "geometry") -> ModelGeometry:
    """The inverse of `geometry_to_dict`; malformed input raises InvalidInput naming the field."""
    if not isinstance(data, dict):
        raise InvalidInput(f"{field}: expected an object, got {type(data).__name__}")
    layers_data = data.get("layers")
    if not isinstance(layers_data, list):
        raise InvalidInput(f"{field}.layers: expected a list")
    layers = []
    for i, item in enumerate(layers_data):
        where = f"{field}.layers[{i}]"
        if not isinstance(item, dict):
            raise InvalidInput(f"{where}: expected an object")
        item = dict(item)
        try:
            kind = LayerKind(item.pop("kind", None))
        except ValueError:
            raise InvalidInput(
                f"{where}.kind: expected one of {[k.value for k in LayerKind]}"
            ) from None
        index = item.pop("index", None)
        cls = _SPECS[kind]
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(index, int) or set(item) != names:
            raise InvalidInput(
                f"{where}: expected integer fields index, {', '.join(sorted(names))}"
            )
        for name, value in item.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(f"{where}.{name}: expected a positive integer, got {value!r}")
        layers.append(LayerSpec(index, cls(**item)))
    try:
        return ModelGeometry(
            str(data["name"]),
            tuple(layers),
            int(data["hidden_size"]),
            int(data.get("vocab_size", 512)),
            int(data.get("num_hidden_layers", 0)),
            canonical_dtype(data.get("dtype", "bfloat16"), f"{field}.dtype"),
            None
            if data.get("ssm_dtype") is None
            else canonical_dtype(data["ssm_dtype"], f"{field}.ssm_dtype"),
        )
    except (KeyError, TypeError) as exc:
        raise InvalidInput(f"{field}: missing or malformed field {exc}") from None


def geometry_hash(geometry: ModelGeometry) -> str:
    """sha256 of the canonical JSON of the geometry (16 hex digits)."""
    text = json.dumps(geometry_to_dict(geometry), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


LAYOUT_FIELDS = (
    "version",
    "geometry",
    "tp",
    "rank",
    "block_size",
    "num_blocks",
    "num_slots",
    "dtypes",
    "options",
    "kv_reserved_bytes",
    "state_reserved_bytes",
    "staging_bytes",
    "progress_bytes",
)


def layout_kwargs(data: Any) -> dict[str, Any]:
    """`Layout(**layout_kwargs(layout.to_dict()))` rebuilds the layout (values are checked
    by `Layout` itself)."""
    if not isinstance(data, dict):
        raise InvalidInput(f"layout: expected an object, got {type(data).__name__}")
    if set(data) != set(LAYOUT_FIELDS):
        missing = sorted(set(LAYOUT_FIELDS) - set(data))
        extra = sorted(set(data) - set(LAYOUT_FIELDS))
        raise InvalidInput(f"layout: missing fields {missing}, unknown fields {extra}")
    for field in ("dtypes", "options"):
        if not isinstance(data[field], dict):
            raise InvalidInput(f"layout.{field}: expected an object")
    try:
        dtypes = CacheDtypes(**data["dtypes"])
        options = LayoutOptions(**data["options"])
    except TypeError as exc:
        raise InvalidInput(f"layout: malformed dtypes or options ({exc})") from None
    kwargs = {k: v for k, v in data.items() if k not in ("geometry", "dtypes", "options")}
    geometry = geometry_from_dict(data["geometry"], "layout.geometry")
    return kwargs | {"geometry": geometry, "dtypes": dtypes, "options": options}
