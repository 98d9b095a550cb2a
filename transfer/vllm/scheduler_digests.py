"""Prefill's digest slots (verify): which finished prefills get a digest table, where.

In the step that computes a verified request's last prompt tokens, the request gets a slot;
the workers write their tables there after the forward (`DigestSpec`), before vLLM sees
the request finish, so the ticket's `digest_offsets` are complete when decode reads them.
The slot is freed with the ticket. No slot free: the request is published unverified.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from transfer.vllm.digests import DIGEST_SLOTS
from transfer.vllm.metadata import DigestSpec, RankHandshake

logger = logging.getLogger(__name__)


class DigestSlots:
    """Thread-safe: slots come back from the TicketStore's threads."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._ranks: tuple[tuple[int, int], ...] = ()  # per rank (digest_start, slot bytes)
        self._lock = threading.Lock()
        self._free = list(range(DIGEST_SLOTS - 1, -1, -1))
        self._planned: dict[str, tuple[int, int]] = {}  # request -> (slot, num_tokens)
        self._held: dict[str, int] = {}  # published request -> slot

    def start(self, handshakes: Mapping[int, RankHandshake]) -> None:
        ranks = tuple((h.digest_start, h.digest_slot_bytes) for _, h in sorted(handshakes.items()))
        if self.enabled and not all(size > 0 for _, size in ranks):
            logger.warning("pdxfer verify: a worker has no digest slots; requests go unverified")
        self._ranks = ranks if self.enabled and all(size > 0 for _, size in ranks) else ()

    def plan(
        self, request_id: str, block_ids: tuple[tuple[int, ...], ...], num_tokens: int
    ) -> DigestSpec | None:
        """A slot for the request whose last prompt tokens this step computes."""
        if not self._ranks or request_id in self._planned:
            return None
        with self._lock:
            slot = self._free.pop() if self._free else None
            if slot is None:
                logger.warning("pdxfer verify: no digest slot free; %s goes unverified", request_id)
                return None
            self._planned[request_id] = (slot, num_tokens)
        return DigestSpec(request_id, block_ids, num_tokens, slot)

    def publish(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        """Per rank, where the finished request's table is; () when it has none for exactly
        `num_tokens` (its slot, if any, is freed)."""
        with self._lock:
            slot, digested = self._planned.pop(request_id, (-1, 0))
            if slot < 0:
                return ()
            if digested != num_tokens:
                self._free.append(slot)
                return ()
            self._held[request_id] = slot
        return tuple(start + slot * size for start, size in self._ranks)

    def free(self, request_id: str) -> None:
        """The request's ticket is gone (or it was not published): its slot comes back."""
        with self._lock:
            slot = self._held.pop(request_id, None)
            if slot is None:
                slot, _ = self._planned.pop(request_id, (None, 0))
            if slot is not None:
                self._free.append(slot)
