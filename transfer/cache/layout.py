"""`Layout`: the single source of byte offsets of one rank's arena.

The arena is `[KV region | state region | progress area | staging area]`, each 64-byte
aligned (the progress area carries layer-wise streaming's readiness words; it may be empty). The layout
is a frozen value computed from a small spec (geometry, TP, rank, counts, dtypes, options),
so the peer rebuilds it from `to_dict()`. Within a region, bytes are packed tightly; the
memory plan's page padding, when given, is reserved at the region's tail, which keeps a
request's blocks contiguous on the wire.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from transfer.cache.codec import geometry_hash, geometry_to_dict, layout_kwargs
from transfer.cache.head_units import (
    KVUnit,
    LayoutOptions,
    StateUnit,
    align,
    build_kv_units,
)
from transfer.cache.state_units import build_state_units
from transfer.errors import InvalidInput
from transfer.geometry import ModelGeometry
from transfer.memplan import MemoryPlan
from transfer.sizing import CacheDtypes

if TYPE_CHECKING:
    import torch

LAYOUT_VERSION = 1
REGION_ALIGN = 64


@dataclass(frozen=True)
class Layout:
    """Byte offsets of every KV head and state head/group of one TP rank.

    `kv_reserved_bytes` / `state_reserved_bytes` (None: exactly what the units need) size
    the regions as the memory plan does, padding included.
    """

    geometry: ModelGeometry
    tp: int
    rank: int
    block_size: int
    num_blocks: int
    num_slots: int
    dtypes: CacheDtypes = CacheDtypes()
    options: LayoutOptions = LayoutOptions()
    kv_reserved_bytes: int | None = None
    state_reserved_bytes: int | None = None
    staging_bytes: int = 0
    progress_bytes: int = 0
    version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        for field, low in (
            ("tp", 1),
            ("rank", 0),
            ("block_size", 1),
            ("num_blocks", 0),
            ("num_slots", 0),
            ("staging_bytes", 0),
            ("progress_bytes", 0),
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidInput(f"{field} must be an integer >= {low}, got {value!r}")
        for field in ("kv_reserved_bytes", "state_reserved_bytes"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InvalidInput(f"{field} must be an integer or None, got {value!r}")
        if self.rank >= self.tp:
            raise InvalidInput(f"rank {self.rank} out of range for tp={self.tp}")
        if self.version != LAYOUT_VERSION:
            raise InvalidInput(f"version {self.version} unsupported (this build: {LAYOUT_VERSION})")
        for field in ("kv", "ssm", "conv"):
            if getattr(self.dtypes, field) not in (1, 2, 4, 8):
                raise InvalidInput(f"dtypes.{field}: element size must be 1, 2, 4 or 8 bytes")
        self.geometry.check_tp(self.tp)
        for field, natural in (
            ("kv_reserved_bytes", self._kv[1]),
            ("state_reserved_bytes", self._state[1]),
        ):
            reserved = getattr(self, field)
            if reserved is not None and reserved < natural:
                raise InvalidInput(f"{field}={reserved} is below the {natural} B the units need")

    @classmethod
    def from_memplan(
        cls,
        geometry: ModelGeometry,
        tp: int,
        rank: int,
        plan: MemoryPlan,
        dtypes: CacheDtypes | None = None,
        options: LayoutOptions | None = None,
        staging_bytes: int = 0,
        progress_bytes: int = 0,
    ) -> Layout:
        """The layout of a rank sized by `plan` (its placement overrides `options`')."""
        options = dataclasses.replace(options or LayoutOptions(), state_placement=plan.placement)
        return cls(
            geometry,
            tp,
            rank,
            plan.block_size,
            plan.num_kv_blocks,
            plan.num_state_slots,
            dtypes or CacheDtypes(),
            options,
            kv_reserved_bytes=plan.num_kv_blocks * plan.kv_block_bytes,
            state_reserved_bytes=plan.num_state_slots * plan.state_slot_bytes,
            staging_bytes=staging_bytes,
            progress_bytes=progress_bytes,
        )

    def peer(self, rank: int) -> Layout:
        """The same layout for another rank of this instance."""
        return dataclasses.replace(self, rank=rank)

    def all_ranks(self) -> tuple[Layout, ...]:
        return tuple(self.peer(r) for r in range(self.tp))

    # --- regions -------------------------------------------------------------------------

    @cached_property
    def _kv(self) -> tuple[tuple[KVUnit, ...], int]:
        return build_kv_units(
            self.geometry,
            self.tp,
            self.rank,
            self.block_size,
            self.num_blocks,
            self.dtypes.kv,
            self.options.kv_order,
            self.options.layer_group,
        )

    @cached_property
    def _state(self) -> tuple[tuple[StateUnit, ...], int]:
        units, size = build_state_units(
            self.geometry,
            self.tp,
            self.rank,
            self.num_slots,
            self.dtypes,
            self.options.state_placement,
            self.options.conv_order,
            self.options.ssm_order,
            self.options.layer_group,
        )
        offset = self.state_offset
        return tuple(dataclasses.replace(u, base=u.base + offset) for u in units), size

    @property
    def kv_region_bytes(self) -> int:
        return self._kv[1] if self.kv_reserved_bytes is None else self.kv_reserved_bytes

    @property
    def state_offset(self) -> int:
        return align(self.kv_region_bytes, REGION_ALIGN)

    @property
    def state_region_bytes(self) -> int:
        return self._state[1] if self.state_reserved_bytes is None else self.state_reserved_bytes

    @property
    def progress_offset(self) -> int:
        return align(self.state_offset + self.state_region_bytes, REGION_ALIGN)

    @property
    def staging_offset(self) -> int:
        return align(self.progress_offset + self.progress_bytes, REGION_ALIGN)

    @property
    def arena_bytes(self) -> int:
        return align(self.staging_offset + self.staging_bytes, REGION_ALIGN)

    # --- units ---------------------------------------------------------------------------

    def kv_units(self) -> tuple[KVUnit, ...]:
        return self._kv[0]

    def state_units(self) -> tuple[StateUnit, ...]:
        return self._state[0]

    @cached_property
    def _kv_index(self) -> dict[tuple, KVUnit]:
        return {(u.layer, u.tensor, u.segment, u.unit): u for u in self.kv_units()}

    @cached_property
    def _state_index(self) -> dict[tuple, StateUnit]:
        return {(u.layer, u.tensor, u.segment, u.unit): u for u in self.state_units()}

    def kv_unit(self, layer: int, tensor: str, segment: int, unit: int) -> KVUnit:
        return self._kv_index[layer, tensor, segment, unit]

    def state_unit(self, layer: int, tensor: str, segment: int, unit: int) -> StateUnit:
        return self._state_index[layer, tensor, segment, unit]

    def tensor_kv_units(self, layer: int, tensor: str) -> tuple[KVUnit, ...]:
        """The rank's heads of one KV tensor, in channel order."""
        return tuple(u for u in self.kv_units() if u.layer == layer and u.tensor == tensor)

    def tensor_state_units(self, layer: int, tensor: str) -> tuple[StateUnit, ...]:
        return tuple(u for u in self.state_units() if u.layer == layer and u.tensor == tensor)

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(u.nbytes for u in self.kv_units())

    @property
    def state_bytes_per_slot(self) -> int:
        return sum(u.nbytes for u in self.state_units())

    @property
    def has_kv(self) -> bool:
        return bool(self.geometry.attention_layers)

    @property
    def has_state(self) -> bool:
        return bool(self.geometry.linear_layers)

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks a request of `num_tokens` occupies (0 without attention layers)."""
        return math.ceil(num_tokens / self.block_size) if self.has_kv else 0

    # --- typed views (torch) -------------------------------------------------------------

    def kv_view(self, arena: torch.Tensor, layer: int, tensor: str, dtype=None) -> torch.Tensor:
        """GQA: `[num_blocks, block_size, rank_kv_heads, head_dim]`; MLA (`tensor="kv"`):
        `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`. Strided per the order."""
        from transfer.cache.views import kv_view

        return kv_view(self, arena, layer, tensor, dtype)

    def ssm_view(self, arena: torch.Tensor, layer: int, dtype=None) -> torch.Tensor:
        """`[num_slots, rank_heads, K, V]`: GDN (head_k_dim, head_v_dim), KDA (head_dim,
        head_dim), Mamba2 (head_dim, state_size)."""
        from transfer.cache.views import ssm_view

        return ssm_view(self, arena, layer, dtype)

    def conv_view(
        self, arena: torch.Tensor, layer: int, tensor: str = "conv", dtype=None
    ) -> torch.Tensor:
        """`[num_slots, rank_channels, conv_kernel - 1]` (a transposed view when time-major).
        GDN "conv" is the rank's q|k|v channels, Mamba2 x|B|C; KDA has conv_q/conv_k/conv_v."""
        from transfer.cache.views import conv_view

        return conv_view(self, arena, layer, tensor, dtype)

    def staging_view(self, arena: torch.Tensor) -> torch.Tensor:
        """uint8 `[staging_bytes]`: the pack/unpack area inside the registered arena."""
        return arena[self.staging_offset : self.staging_offset + self.staging_bytes]

    # --- handshake -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-able spec; `Layout.from_dict` rebuilds the identical layout."""
        return {
            "version": self.version,
            "geometry": geometry_to_dict(self.geometry),
            "tp": self.tp,
            "rank": self.rank,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "num_slots": self.num_slots,
            "dtypes": dataclasses.asdict(self.dtypes),
            "options": {
                k: getattr(v, "value", v) for k, v in dataclasses.asdict(self.options).items()
            },
            "kv_reserved_bytes": self.kv_reserved_bytes,
            "state_reserved_bytes": self.state_reserved_bytes,
            "staging_bytes": self.staging_bytes,
            "progress_bytes": self.progress_bytes,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Layout:
        """The inverse of `to_dict`; malformed input raises InvalidInput naming the field."""
        return cls(**layout_kwargs(data))

    def compat_fields(self) -> dict[str, Any]:
        """What both sides of a transfer must agree on, for the control-plane handshake."""
        return {
            "geometry": self.geometry.name,
            "geometry_hash": geometry_hash(self.geometry),
            "dtypes": f"kv={self.dtypes.kv},ssm={self.dtypes.ssm},conv={self.dtypes.conv}",
            "block_size": self.block_size,
            "layout_version": self.version,
        }
