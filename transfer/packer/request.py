"""The packer's inputs, and their validation (before anything is planned or changed)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from transfer.cache.codec import geometry_hash
from transfer.cache.layout import Layout
from transfer.errors import InvalidInput


def _ids(values: int | Sequence[int], field: str) -> tuple[int, ...]:
    if isinstance(values, int) and not isinstance(values, bool):
        values = (values,)
    try:
        ids = tuple(values)
    except TypeError:
        raise InvalidInput(f"{field}: expected a sequence of integer ids, got {values!r}") from None
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise InvalidInput(f"{field}: ids must be integers, got {i!r}")
    return ids


@dataclass(frozen=True)
class TransferRequest:
    """One request's cache on both sides. Slots are the request's slot followed by its
    speculative-decoding slots; they pair up in order (src_slots[i] -> dst_slots[i])."""

    num_tokens: int
    src_blocks: tuple[int, ...]
    src_slots: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    dst_slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if (
            isinstance(self.num_tokens, bool)
            or not isinstance(self.num_tokens, int)
            or self.num_tokens < 1
        ):
            raise InvalidInput(f"num_tokens must be an integer >= 1, got {self.num_tokens!r}")
        for field in ("src_blocks", "src_slots", "dst_blocks", "dst_slots"):
            object.__setattr__(self, field, _ids(getattr(self, field), field))


def _check_instance(layouts: Sequence[Layout], side: str) -> Layout:
    if not layouts:
        raise InvalidInput(f"{side} layouts: empty; give one layout per rank")
    first = layouts[0]
    for i, layout in enumerate(layouts):
        if not isinstance(layout, Layout):
            raise InvalidInput(
                f"{side} layouts[{i}]: expected a Layout, got {type(layout).__name__}"
            )
        if layout.tp != len(layouts) or layout.rank != i:
            raise InvalidInput(
                f"{side} layouts[{i}]: has tp={layout.tp}, rank={layout.rank}; expected "
                f"tp={len(layouts)}, rank={i} (one layout per rank, in rank order)"
            )
        for field in dataclasses.fields(Layout):
            if field.name != "rank" and getattr(layout, field.name) != getattr(first, field.name):
                raise InvalidInput(f"{side} layouts[{i}]: {field.name} differs from layouts[0]")
    return first


def _check_ids(ids: tuple[int, ...], count: int, field: str, what: str) -> None:
    for i in ids:
        if not 0 <= i < count:
            raise InvalidInput(f"{field}: {what} id {i} out of range [0, {count})")
    if len(set(ids)) != len(ids):
        raise InvalidInput(f"{field}: duplicate {what} ids")


def validate_layouts(prefill: Sequence[Layout], decode: Sequence[Layout]) -> None:
    """Raise InvalidInput naming the field unless the packer can plan between these two
    instances (one layout per rank, in rank order, on each side)."""
    p, d = _check_instance(prefill, "prefill"), _check_instance(decode, "decode")
    if p.geometry != d.geometry:
        raise InvalidInput(
            f"geometry: decode has {d.geometry.name!r} ({geometry_hash(d.geometry)}), "
            f"prefill has {p.geometry.name!r} ({geometry_hash(p.geometry)})"
        )
    if p.dtypes != d.dtypes:
        raise InvalidInput(f"dtypes: prefill {p.dtypes} differs from decode {d.dtypes}")


def validate_request(p: Layout, d: Layout, request: TransferRequest) -> None:
    """Raise InvalidInput naming the field for a `request` the packer cannot plan between
    instances that passed `validate_layouts` (`p`, `d`: a layout of each)."""
    n = request.num_tokens
    for field, layout, side in (("src_blocks", p, "prefill"), ("dst_blocks", d, "decode")):
        ids = getattr(request, field)
        need = layout.blocks_for(n)
        if len(ids) != need:
            raise InvalidInput(
                f"{field}: {len(ids)} blocks given; {n} tokens at {side} block_size "
                f"{layout.block_size} need {need}"
            )
        _check_ids(ids, layout.num_blocks, field, "block")
    if len(request.src_slots) != len(request.dst_slots):
        raise InvalidInput(
            f"src_slots, dst_slots: unequal slot counts ({len(request.src_slots)} vs "
            f"{len(request.dst_slots)})"
        )
    if p.has_state and not request.src_slots:
        raise InvalidInput("src_slots: the model has linear layers; give the request's slot")
    for field, layout in (("src_slots", p), ("dst_slots", d)):
        _check_ids(getattr(request, field), layout.num_slots, field, "slot")


def validate(prefill: Sequence[Layout], decode: Sequence[Layout], request: TransferRequest) -> None:
    """Raise InvalidInput naming the field for any input the packer cannot plan."""
    validate_layouts(prefill, decode)
    validate_request(prefill[0], decode[0], request)
