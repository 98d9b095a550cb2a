"""Which of a request's vLLM block ids hold the bytes that cross, per KV-cache group.

vLLM hands the connector one block list per KV-cache group. Only the transfer groups cross,
and of each only what carries the request's cache: an attention group's first
cdiv(num_tokens, block_size) blocks (full attention; a sliding window keeps its tail), a mamba
group's one running-state block (vLLM pads the list with null blocks in front and may append
speculative scratch blocks). Prefill and decode clip the same way, so their lists line up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, SlidingWindowSpec

from transfer.errors import InvalidInput

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class _Group:
    block_size: int
    is_attention: bool
    window_blocks: int  # sliding window: blocks kept from the tail; 0 = all
    scratch_blocks: int  # mamba: speculative scratch blocks vLLM appends


class TransferGroups:
    """The transfer groups of one `KVCacheConfig`, and how to clip a request's block ids.

    `ticket_group`: the index (among transfer groups) of the first full-attention group, whose
    blocks stand for the request in pdxfer's TicketStore (one block per `block_size` tokens).
    """

    def __init__(self, kv_cache_config: KVCacheConfig):
        groups: list[_Group] = []
        for group in kv_cache_config.transfer_groups:
            spec = group.kv_cache_spec
            window = 0
            if isinstance(spec, SlidingWindowSpec):
                window = _cdiv(spec.sliding_window, spec.block_size) + 1
            groups.append(
                _Group(
                    block_size=spec.block_size,
                    is_attention=isinstance(spec, AttentionSpec),
                    window_blocks=window,
                    scratch_blocks=spec.num_speculative_blocks
                    if isinstance(spec, MambaSpec)
                    else 0,
                )
            )
        ticket_group = next(
            (i for i, g in enumerate(groups) if g.is_attention and not g.window_blocks), None
        )
        if ticket_group is None:
            raise InvalidInput(
                "kv_cache_config: PdxferConnector needs a full-attention KV-cache group "
                "(this model has none among its transfer groups)"
            )
        self._kv_cache_config = kv_cache_config
        self._groups = tuple(groups)
        self.ticket_group = ticket_group
        self.block_size = groups[ticket_group].block_size

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def num_attention(self) -> int:
        """How many transfer groups page tokens."""
        return sum(g.is_attention for g in self._groups)

    def clip(
        self, all_group_block_ids: Sequence[Sequence[int]], num_tokens: int
    ) -> tuple[tuple[int, ...], ...]:
        """From vLLM's per-group block ids (every group, as the scheduler passes them), the
        blocks holding the cache of the first `num_tokens` tokens, per transfer group."""
        selected = self._kv_cache_config.select_transfer_block_ids(
            [list(ids) for ids in all_group_block_ids]
        )
        clipped: list[tuple[int, ...]] = []
        for group, ids in zip(self._groups, selected, strict=True):
            if group.is_attention:
                ids = ids[: _cdiv(num_tokens, group.block_size)]
                if group.window_blocks:
                    ids = ids[-group.window_blocks :]
            elif ids:
                scratch = min(group.scratch_blocks, len(ids) - 1)
                ids = (ids[:-scratch] if scratch else ids)[-1:]
            clipped.append(tuple(ids))
        return tuple(clipped)

    def ticket_blocks(self, clipped: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
        """The blocks that stand for a request in the TicketStore."""
        return clipped[self.ticket_group]
