"""Prefill's stage slots: which finished prefills get their partial last block staged, where.

A prompt that ends inside an attention block gets a slot in the step that computes its last
tokens (`StageSpec`): the workers gather that block's tokens into the slot after the
forward (`stage_tail`), before vLLM sees the request finish, so the ticket's
`staged_offsets` are complete when decode reads them. The slot is freed with the ticket.
No slot free: the whole last block crosses.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from transfer.vllm.metadata import RankHandshake, StageSpec
from transfer.vllm.scheduler_groups import TransferGroups
from transfer.vllm.stage_tail import STAGE_SLOTS

if TYPE_CHECKING:
    from vllm.v1.request import Request


class StageSlots:
    """Thread-safe: slots come back from the TicketStore's threads."""

    def __init__(self, groups: TransferGroups) -> None:
        self._groups = groups
        # Every rank's (stage_start, slot bytes); () when some rank has none.
        self._ranks: tuple[tuple[int, int], ...] = ()
        self._lock = threading.Lock()
        self._free = list(range(STAGE_SLOTS - 1, -1, -1))
        self._planned: dict[str, tuple[int, int]] = {}  # request -> (slot, num_tokens)
        self._held: dict[str, int] = {}  # published request -> slot

    def start(self, handshakes: Mapping[int, RankHandshake]) -> None:
        """Stage only with one attention group and stage slots on every rank."""
        stage = tuple(
            (handshakes[r].stage_start, handshakes[r].stage_slot_bytes) for r in sorted(handshakes)
        )
        if self._groups.num_attention == 1 and all(size > 0 for _, size in stage):
            self._ranks = stage

    def plan(
        self, request: Request, scheduled: int, block_ids: Sequence[Sequence[int]]
    ) -> StageSpec | None:
        """A slot for the partial last block of the prompt whose last tokens this step
        computes (`scheduled` of them); `block_ids`: the request's ids per vLLM group."""
        req_id = request.request_id
        if req_id in self._planned or not self._ranks:
            return None
        num_tokens = request.num_prompt_tokens
        partial = num_tokens % self._groups.block_size
        if not partial or request.num_computed_tokens + scheduled < num_tokens:
            return None
        with self._lock:
            slot = self._free.pop() if self._free else None
        if slot is None:
            return None  # the whole last block crosses
        clipped = self._groups.clip(block_ids, num_tokens)
        block = self._groups.ticket_blocks(clipped)[-1]
        self._planned[req_id] = (slot, num_tokens)
        return StageSpec(req_id, block, partial, slot)

    def take(self, request_id: str, num_tokens: int) -> tuple[int, tuple[int, ...]]:
        """The finished request's stage slot and its offsets per rank, (-1, ()) when none
        holds its `num_tokens` (the slot, if any, is freed). A slot taken is `hold` before
        its ticket goes live, then `free`d with the ticket or when it is not published."""
        slot, staged_tokens = self._planned.pop(request_id, (-1, 0))
        if slot >= 0 and staged_tokens != num_tokens:
            self.put_back(slot)
            slot = -1
        if slot < 0:
            return -1, ()
        return slot, tuple(start + slot * size for start, size in self._ranks)

    def hold(self, request_id: str, slot: int) -> None:
        """The request was published with `slot`: it is freed with the ticket (`free`)."""
        with self._lock:
            self._held[request_id] = slot

    def put_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def free(self, request_id: str) -> None:
        """The request's ticket is gone: its slot, if it holds one, comes back."""
        with self._lock:
            slot = self._held.pop(request_id, None)
            if slot is not None:
                self._free.append(slot)
