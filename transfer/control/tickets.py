"""TicketStore: the prefill side's live tickets, their leases, and who frees what.

Lifecycle of one ticket (see docs/control.md):

    publish -> PUBLISHED --acquire--> ACQUIRED --heartbeat--> ACQUIRED
                   |                     |
                   +--- abort / lease expiry / release (ACQUIRED only) ---> freed

Freeing is the owner's job: the store calls `on_free(ticket, reason)` exactly
once per ticket, outside its lock, after the ticket has left the live set. A
ticket leaves the live set under the lock, so release, abort and expiry racing
for the same ticket cannot free it twice.

Leases sit in a min-heap keyed by deadline. A heartbeat pushes a new entry and
leaves the old one behind; an entry counts only while it is the ticket's
current one (lazy invalidation). Expiry is therefore correct whatever order
deadlines arrive in, and a renewed lease is never reaped at its old deadline.
"""

from __future__ import annotations

import heapq
import hmac
import itertools
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from transfer.control.errors import NotPermitted, TicketStateError, UnknownRequest
from transfer.control.types import (
    ControlConfig,
    FreeReason,
    Ticket,
    validate_blocks,
    validate_id,
    validate_ticket_fields,
)
from transfer.errors import DeadlineExceeded, InvalidInput, WrongState

if TYPE_CHECKING:
    from transfer.control.metrics import WorkerMetrics

logger = logging.getLogger(__name__)

OnFree = Callable[[Ticket, FreeReason], None]


@dataclass
class _Live:
    ticket: Ticket
    holder: str  # "" until acquired
    seq: int  # the heap entry that currently counts


class TicketStore:
    """Thread-safe live tickets with leases; `start()` runs the background reaper.

    `clock` returns unix seconds (injectable for tests); `history` bounds how many
    freed request ids are remembered, only to say why a late call finds nothing.
    """

    def __init__(
        self,
        config: ControlConfig,
        on_free: OnFree,
        *,
        instance_id: str = "",
        address: str = "",
        clock: Callable[[], float] = time.time,
        metrics: WorkerMetrics | None = None,
        history: int = 4096,
        max_wait_s: float = 1.0,
    ):
        self.config = config
        self.instance_id = instance_id
        self.address = address
        self._on_free = on_free
        self._clock = clock
        self._metrics = metrics
        self._history = history
        self._max_wait_s = max_wait_s
        self._cond = threading.Condition(threading.Lock())
        self._live: dict[str, _Live] = {}
        self._slots: dict[int, str] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._freed: OrderedDict[str, FreeReason] = OrderedDict()
        self._reaper: threading.Thread | None = None
        self._stopping = False
        self.expired_total = 0
        if metrics is not None:
            metrics.tickets_active.set_function(self.__len__)

    # ---- prefill side -------------------------------------------------------------------

    def publish(
        self,
        request_id: str,
        block_ids: tuple[int, ...] | list[int],
        slot_id: int,
        num_tokens: int,
        first_token: int,
        *,
        lease_s: float | None = None,
        first_logprob: float = 0.0,
        cached_tokens: int = 0,
        block_hashes: tuple[bytes, ...] = (),
        stream_key: int = 0,
    ) -> Ticket:
        """Publish a finished prefill, or with a `stream_key` one that has only its cache
        allocated (layer-wise streaming). Raises `InvalidInput` naming the field; a rejected
        call changes nothing."""
        block_ids = tuple(int(b) for b in block_ids)
        validate_ticket_fields(request_id, block_ids, slot_id, num_tokens, first_token, self.config)
        if not 0 <= cached_tokens < num_tokens:
            raise InvalidInput(
                f"cached_tokens: must be in [0, num_tokens={num_tokens}), got {cached_tokens}"
            )
        lease_s = self.config.lease_s if lease_s is None else lease_s
        if not (math.isfinite(lease_s) and lease_s > 0):
            raise InvalidInput(f"lease_s: must be a positive number of seconds, got {lease_s!r}")
        with self._cond:
            if request_id in self._live:
                raise InvalidInput(f"request_id: {request_id!r} already has a live ticket")
            if slot_id in self._slots:
                raise InvalidInput(
                    f"slot_id: slot {slot_id} is held by live ticket {self._slots[slot_id]!r}"
                )
            ticket = Ticket(
                request_id=request_id,
                instance_id=self.instance_id,
                block_ids=block_ids,
                slot_id=slot_id,
                num_tokens=num_tokens,
                first_token=first_token,
                lease_deadline=self._clock() + lease_s,
                address=self.address,
                first_logprob=first_logprob,
                abort_key=secrets.token_hex(16),
                cached_tokens=cached_tokens,
                block_hashes=tuple(block_hashes),
                stream_key=stream_key,
            )
            live = _Live(ticket, holder="", seq=-1)
            self._live[request_id] = live
            self._slots[slot_id] = request_id
            self._push(live)
        return ticket

    # ---- decode side and router ---------------------------------------------------------

    def acquire(self, request_id: str, holder: str) -> Ticket:
        """Claim a ticket for decode instance `holder` and renew its lease; idempotent for the same holder."""
        validate_id(request_id, "request_id")
        validate_id(holder, "holder")
        with self._cond:
            live = self._get(request_id)
            if live.holder and live.holder != holder:
                raise TicketStateError(
                    f"request {request_id!r} is held by {live.holder!r}, not {holder!r}"
                )
            live.holder = holder
            return self._renew(live)

    def heartbeat(self, request_id: str, holder: str) -> Ticket:
        """Extend the lease of an acquired ticket to now + lease_s (never shortens it)."""
        validate_id(request_id, "request_id")
        validate_id(holder, "holder")
        with self._cond:
            live = self._get_held(request_id, holder)
            return self._renew(live)

    def release(
        self, request_id: str, holder: str, block_ids: tuple[int, ...] | list[int], slot_id: int
    ) -> Ticket:
        """The holder has read the cache: free it. `block_ids`/`slot_id` must match the ticket exactly."""
        block_ids = tuple(int(b) for b in block_ids)
        validate_id(request_id, "request_id")
        validate_id(holder, "holder")
        validate_blocks(block_ids, slot_id, self.config)
        with self._cond:
            live = self._get_held(request_id, holder)
            ticket = live.ticket
            if len(block_ids) != len(ticket.block_ids):
                raise InvalidInput(
                    f"block_ids: {len(block_ids)} blocks, ticket {request_id!r} has {len(ticket.block_ids)}"
                )
            for i, (got, want) in enumerate(zip(block_ids, ticket.block_ids, strict=True)):
                if got != want:
                    raise InvalidInput(
                        f"block_ids[{i}]: {got} does not match ticket {request_id!r} (block {want})"
                    )
            if slot_id != ticket.slot_id:
                raise InvalidInput(
                    f"slot_id: {slot_id} does not match ticket {request_id!r} (slot {ticket.slot_id})"
                )
            self._remove(live, FreeReason.RELEASED)
        self._on_free(ticket, FreeReason.RELEASED)
        return ticket

    def abort(self, request_id: str, reason: str = "", abort_key: str | None = None) -> Ticket:
        """Drop a request in any state and free its cache. A remote caller must present the
        ticket's `abort_key` (NotPermitted otherwise); None is a local, trusted call."""
        validate_id(request_id, "request_id")
        with self._cond:
            live = self._get(request_id)
            if abort_key is not None and not hmac.compare_digest(
                abort_key.encode(), live.ticket.abort_key.encode()
            ):
                raise NotPermitted(f"request {request_id!r}: abort_key does not match its ticket")
            self._remove(live, FreeReason.ABORTED)
        logger.info("aborted request %r%s", request_id, f": {reason}" if reason else "")
        self._on_free(live.ticket, FreeReason.ABORTED)
        return live.ticket

    # ---- leases -------------------------------------------------------------------------

    def reap(self, now: float | None = None) -> list[Ticket]:
        """Free every ticket whose lease ended at or before `now` (default: the clock). Returns them."""
        expired: list[Ticket] = []
        with self._cond:
            now = self._clock() if now is None else now
            while self._heap and self._heap[0][0] <= now:
                _, seq, request_id = heapq.heappop(self._heap)
                live = self._live.get(request_id)
                if live is None or live.seq != seq:
                    continue  # stale: freed already, or the lease was renewed
                self._remove(live, FreeReason.EXPIRED)
                expired.append(live.ticket)
            if len(self._heap) > 2 * len(self._live) + 64:
                self._heap = [
                    (lv.ticket.lease_deadline, lv.seq, rid) for rid, lv in self._live.items()
                ]
                heapq.heapify(self._heap)
            self.expired_total += len(expired)
        if expired and self._metrics is not None:
            self._metrics.leases_expired.inc(len(expired))
        for ticket in expired:
            logger.warning(
                "lease expired for request %r (holder gone?); freeing its cache", ticket.request_id
            )
            try:
                self._on_free(ticket, FreeReason.EXPIRED)
            except Exception:
                logger.exception("on_free failed for expired request %r", ticket.request_id)
        return expired

    def start(self) -> TicketStore:
        """Start the reaper thread: it sleeps until the earliest deadline (at most `max_wait_s`)."""
        with self._cond:
            if self._reaper is not None:
                raise WrongState("reaper already started")
            self._stopping = False
            self._reaper = threading.Thread(
                target=self._reap_loop, name="pdxfer-lease-reaper", daemon=True
            )
        self._reaper.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the reaper thread. Live tickets stay live (and owned by the caller)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.join(timeout)
            if reaper.is_alive():
                raise DeadlineExceeded(f"lease reaper did not stop within {timeout}s")

    def __enter__(self) -> TicketStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- inspection ---------------------------------------------------------------------

    def __len__(self) -> int:
        with self._cond:
            return len(self._live)

    def get(self, request_id: str) -> Ticket | None:
        with self._cond:
            live = self._live.get(request_id)
            return None if live is None else live.ticket

    def holder(self, request_id: str) -> str:
        """The decode instance holding the ticket, "" if published but not acquired."""
        with self._cond:
            return self._get(request_id).holder

    # ---- internals (caller holds the lock) ----------------------------------------------

    def _get(self, request_id: str) -> _Live:
        live = self._live.get(request_id)
        if live is None:
            why = self._freed.get(request_id)
            suffix = f" (already {why.value})" if why else ""
            raise UnknownRequest(f"request_id {request_id!r}: no live ticket{suffix}")
        return live

    def _get_held(self, request_id: str, holder: str) -> _Live:
        live = self._get(request_id)
        if live.holder != holder:
            state = f"held by {live.holder!r}" if live.holder else "not acquired"
            raise TicketStateError(f"request {request_id!r} is {state}; caller is {holder!r}")
        return live

    def _renew(self, live: _Live) -> Ticket:
        deadline = max(live.ticket.lease_deadline, self._clock() + self.config.lease_s)
        if deadline != live.ticket.lease_deadline:
            live.ticket = replace(live.ticket, lease_deadline=deadline)
            self._push(live)
        return live.ticket

    def _push(self, live: _Live) -> None:
        live.seq = next(self._seq)
        earliest = self._heap[0][0] if self._heap else math.inf
        heapq.heappush(self._heap, (live.ticket.lease_deadline, live.seq, live.ticket.request_id))
        if live.ticket.lease_deadline < earliest:
            self._cond.notify_all()

    def _remove(self, live: _Live, reason: FreeReason) -> None:
        request_id = live.ticket.request_id
        del self._live[request_id]
        del self._slots[live.ticket.slot_id]
        self._freed[request_id] = reason
        while len(self._freed) > self._history:
            self._freed.popitem(last=False)

    def _reap_loop(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    return
                wait = self._max_wait_s
                if self._heap:
                    wait = min(wait, max(0.0, self._heap[0][0] - self._clock()))
                if wait > 0:
                    self._cond.wait(wait)
                if self._stopping:
                    return
            try:
                self.reap()
            except Exception:
                logger.exception("lease reaper iteration failed")
