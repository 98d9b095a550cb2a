"""`ExplicitLayout`: a `Layout` over memory an engine laid out itself (vLLM's KV cache).

pdxfer's own arena is computed from a spec (`Layout`); an engine's memory is not. Here the
units are given one by one, their offsets in a virtual offset space over the registered
regions (`transfer.dataplane.regions.RegionMap`), so the packer plans reads over it
unchanged. Blocks and state slots are the engine's block ids: a state slot is a block id of
the engine's state pool, `slot_stride` apart like its blocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from transfer.cache.codec import layout_kwargs
from transfer.cache.head_units import KVUnit, StateUnit
from transfer.cache.layout import Layout
from transfer.errors import InvalidInput
from transfer.geometry import Role

EXPLICIT_KEY = "explicit"


@dataclass(frozen=True)
class ExplicitLayout(Layout):
    """Units placed by the engine. `extent`: the virtual bytes the units may touch (the
    registered regions' virtual size); `engine`: what laid them out, for messages and the
    compatibility hash (e.g. "vllm 0.32.0 LBHNC conv=SD").

    Only the fields of `Layout` are compared between the ranks of an instance; the units
    differ per rank (each holds its own heads)."""

    kv: tuple[KVUnit, ...] = ()
    state: tuple[StateUnit, ...] = ()
    extent: int = 0
    engine: str = ""

    def __post_init__(self) -> None:
        if self.staging_bytes or self.progress_bytes:
            raise InvalidInput("explicit layout: staging and progress areas are not supported")
        super().__post_init__()
        if self.extent < 1:
            raise InvalidInput(f"extent: must be >= 1, got {self.extent!r}")
        self._check_units()

    def _check_units(self) -> None:
        expected_kv = {
            (layer.index, tensor.name)
            for layer in self.geometry.attention_layers
            for tensor in layer.cache_tensors()
            if tensor.role is Role.KV
        }
        expected_state = {
            (layer.index, tensor.name)
            for layer in self.geometry.linear_layers
            for tensor in layer.cache_tensors()
        }
        for field, units, expected in (
            ("kv", self.kv, expected_kv),
            ("state", self.state, expected_state),
        ):
            seen = {(u.layer, u.tensor) for u in units}
            if seen != expected:
                raise InvalidInput(
                    f"explicit layout.{field}: units cover {sorted(seen)}, the geometry "
                    f"{self.geometry.name!r} has {sorted(expected)}"
                )
        for u in self.kv:
            last = u.base + (self.num_blocks - 1) * u.block_stride
            last += (self.block_size - 1) * u.token_stride + u.nbytes
            if u.base < 0 or last > self.extent:
                raise InvalidInput(
                    f"explicit layout.kv: layer {u.layer} {u.tensor} head {u.unit} spans "
                    f"[{u.base}, {last}), outside the extent {self.extent}"
                )
        for u in self.state:
            last = u.base + (self.num_slots - 1) * u.slot_stride
            last += (u.elems - 1) * u.elem_stride + (u.steps - 1) * u.step_stride + u.elem_bytes
            if u.base < 0 or last > self.extent:
                raise InvalidInput(
                    f"explicit layout.state: layer {u.layer} {u.tensor} unit {u.unit} spans "
                    f"[{u.base}, {last}), outside the extent {self.extent}"
                )

    @cached_property
    def _kv(self) -> tuple[tuple[KVUnit, ...], int]:
        return self.kv, 0

    @cached_property
    def _state(self) -> tuple[tuple[StateUnit, ...], int]:
        return self.state, 0

    @property
    def staging_offset(self) -> int:
        return self.extent

    @property
    def arena_bytes(self) -> int:
        return self.extent

    def peer(self, rank: int) -> Layout:
        raise InvalidInput("explicit layout: each rank's units come from that rank")

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data[EXPLICIT_KEY] = {
            "kv": [dataclasses.astuple(u) for u in self.kv],
            "state": [[getattr(u, f.name) for f in dataclasses.fields(u)] for u in self.state],
            "extent": self.extent,
            "engine": self.engine,
        }
        for row in data[EXPLICIT_KEY]["state"]:
            row[2] = row[2].value  # Role
        return data

    @classmethod
    def from_dict(cls, data: Any) -> ExplicitLayout:
        """The inverse of `to_dict`; malformed input raises InvalidInput naming the field."""
        if not isinstance(data, dict) or not isinstance(data.get(EXPLICIT_KEY), dict):
            raise InvalidInput(f"layout.{EXPLICIT_KEY}: missing or not an object")
        body = data[EXPLICIT_KEY]
        base = layout_kwargs({k: v for k, v in data.items() if k != EXPLICIT_KEY})
        try:
            kv = tuple(KVUnit(*row) for row in body["kv"])
            state = tuple(
                StateUnit(row[0], row[1], Role(row[2]), *row[3:]) for row in body["state"]
            )
            extent, engine = body["extent"], body["engine"]
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"layout.{EXPLICIT_KEY}: malformed units ({exc})") from None
        for name, rows in (("kv", kv), ("state", state)):
            for row in rows:
                values = dataclasses.astuple(row)
                if not all(isinstance(v, int | str) for v in values):
                    raise InvalidInput(f"layout.{EXPLICIT_KEY}.{name}: non-integer field")
        if not isinstance(extent, int) or not isinstance(engine, str):
            raise InvalidInput(f"layout.{EXPLICIT_KEY}: extent/engine malformed")
        return cls(**base, kv=kv, state=state, extent=extent, engine=engine)
