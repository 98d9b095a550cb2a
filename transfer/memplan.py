"""Memory planning: a rank's cache budget -> state slots + KV blocks with one page size.

A single allocator wants one page size (docs/reference.md #3). The planner reserves state for
`max_num_seqs * (1 + spec_tokens)` slots first, picks the KV block size so the attention
page is close to the state page, pads the smaller page up to the larger, and gives the rest
of the budget to KV blocks. The padding is waste, and the plan reports it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from transfer.errors import InvalidInput
from transfer.geometry import LayerKind, ModelGeometry
from transfer.sizing import (
    CacheDtypes,
    attention_kv_bytes_per_token,
    linear_state_bytes,
)


class PagePolicy(str, enum.Enum):
    SEED = "seed"  # block size whose attention page is nearest the state page; pad the smaller
    VLLM = "vllm"  # smallest block size whose attention page >= state page; pad the state page


class StatePlacement(str, enum.Enum):
    PER_REQUEST = "per_request"  # (b) all linear layers of a request in one span: one page a slot
    PER_LAYER = "per_layer"  # (a) one slot array per layer: one page per linear layer per slot


@dataclass(frozen=True)
class MemoryPlan:
    """How one rank's cache budget is split. Pages are `page_bytes` each."""

    budget_bytes: int
    placement: StatePlacement
    page_policy: PagePolicy
    block_size: int
    page_bytes: int
    kv_page_bytes: int  # useful bytes in a KV page before padding
    state_page_bytes: int  # useful bytes in a state page before padding
    kv_pages_per_block: int
    state_pages_per_slot: int
    num_kv_blocks: int
    num_state_slots: int  # every slot row, the checkpoint slots included
    padding_bytes: int
    num_checkpoint_slots: int = 0  # prefix-cache checkpoints: the last ids of the slots

    @property
    def num_request_slots(self) -> int:
        return self.num_state_slots - self.num_checkpoint_slots

    @property
    def checkpoint_slot_ids(self) -> range:
        return range(self.num_request_slots, self.num_state_slots)

    @property
    def kv_block_bytes(self) -> int:
        return self.page_bytes * self.kv_pages_per_block

    @property
    def state_slot_bytes(self) -> int:
        return self.page_bytes * self.state_pages_per_slot

    @property
    def used_bytes(self) -> int:
        return (
            self.num_kv_blocks * self.kv_block_bytes + self.num_state_slots * self.state_slot_bytes
        )

    @property
    def padding_pct(self) -> float:
        return 100.0 * self.padding_bytes / self.used_bytes if self.used_bytes else 0.0


def default_alignment(geometry: ModelGeometry) -> int:
    """Block-size granularity: attention kernels want 16 tokens, MLA kernels 64."""
    return 64 if any(layer.kind is LayerKind.MLA for layer in geometry.layers) else 16


def _choose_block_size(
    kv_bytes_per_token: int,
    state_page: int,
    min_block_size: int,
    alignment: int,
    policy: PagePolicy,
) -> int:
    smallest = alignment * math.ceil(min_block_size / alignment)
    if state_page == 0:
        return smallest
    covering = alignment * math.ceil(state_page / (alignment * kv_bytes_per_token))
    upper = max(smallest, covering)
    if policy is PagePolicy.VLLM:
        return upper
    lower = upper - alignment
    if lower < smallest:
        return upper
    gap_upper = upper * kv_bytes_per_token - state_page
    gap_lower = state_page - lower * kv_bytes_per_token
    return lower if gap_lower < gap_upper else upper


def plan_memory(
    geometry: ModelGeometry,
    tp: int,
    budget_bytes: int,
    max_num_seqs: int,
    block_size: int = 16,
    spec_tokens: int = 0,
    page_policy: PagePolicy | str = PagePolicy.SEED,
    placement: StatePlacement | str = StatePlacement.PER_REQUEST,
    dtypes: CacheDtypes | None = None,
    alignment: int | None = None,
    checkpoint_slots: int = 0,
) -> MemoryPlan:
    """Plan one rank's cache; `checkpoint_slots` more state slots hold prefix-cache
    checkpoints. Raises InvalidInput naming the field for bad input or a short budget."""
    page_policy = PagePolicy(page_policy)
    placement = StatePlacement(placement)
    dtypes = dtypes or CacheDtypes()
    for field, value, low in (
        ("budget_bytes", budget_bytes, 1),
        ("max_num_seqs", max_num_seqs, 1),
        ("block_size", block_size, 1),
        ("spec_tokens", spec_tokens, 0),
        ("checkpoint_slots", checkpoint_slots, 0),
    ):
        if value < low:
            raise InvalidInput(f"{field} must be >= {low}, got {value}")
    alignment = alignment or default_alignment(geometry)
    geometry.check_tp(tp)

    linear = [linear_state_bytes(layer, tp, dtypes).total for layer in geometry.linear_layers]
    attention = [
        attention_kv_bytes_per_token(layer, tp, dtypes) for layer in geometry.attention_layers
    ]
    if placement is StatePlacement.PER_REQUEST:
        state_page = sum(linear)
        kv_per_token = sum(attention)
        state_pages_per_slot = 1 if linear else 0
        kv_pages_per_block = 1 if attention else 0
    else:
        state_page = max(linear, default=0)
        kv_per_token = max(attention, default=0)
        state_pages_per_slot = len(linear)
        kv_pages_per_block = len(attention)

    if kv_per_token:
        chosen = _choose_block_size(kv_per_token, state_page, block_size, alignment, page_policy)
    else:
        chosen = block_size
    kv_page = chosen * kv_per_token
    page = max(kv_page, state_page)

    checkpoints = checkpoint_slots if state_pages_per_slot else 0  # no state: nothing to save
    num_slots = max_num_seqs * (1 + spec_tokens) + checkpoints
    state_reserved = num_slots * state_pages_per_slot * page
    block_bytes = kv_pages_per_block * page
    needed = state_reserved + block_bytes
    if needed > budget_bytes:
        raise InvalidInput(
            f"budget of {budget_bytes} B is too small for max_num_seqs={max_num_seqs} "
            f"(x{1 + spec_tokens} slots with spec_tokens={spec_tokens}, {checkpoint_slots} "
            f"checkpoint slots): state needs "
            f"{state_reserved} B plus {block_bytes} B for one KV block; "
            f"missing {needed - budget_bytes} B"
        )
    num_blocks = (budget_bytes - state_reserved) // block_bytes if block_bytes else 0
    padding = num_slots * state_pages_per_slot * (page - state_page)
    padding += num_blocks * kv_pages_per_block * (page - kv_page)
    return MemoryPlan(
        budget_bytes=budget_bytes,
        placement=placement,
        page_policy=page_policy,
        block_size=chosen,
        page_bytes=page,
        kv_page_bytes=kv_page,
        state_page_bytes=state_page,
        kv_pages_per_block=kv_pages_per_block,
        state_pages_per_slot=state_pages_per_slot,
        num_kv_blocks=num_blocks,
        num_state_slots=num_slots,
        padding_bytes=padding,
        num_checkpoint_slots=checkpoints,
    )
