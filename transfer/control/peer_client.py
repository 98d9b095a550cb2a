"""PeerClient: a decode engine's calls to prefill instances, without blocking the engine.

Every call (Handshake, Acquire, Stage, Heartbeat, Release, Abort) is submitted and returns at
once; a small thread pool runs it, and its result or error comes back as one `PeerEvent` that
the engine drains on its own thread (`drain`), typically once per step. The client knows no
engine: vLLM's connector and pdxfer's own engine use it alike.

Calls for the same (peer, request) run one after another in submission order, so a Release
submitted after an Acquire never overtakes it; calls for different requests run side by side.

A held lease is renewed by the client's own timer (`keep_alive`), not by the engine's steps: an
engine step can outlast a lease (a CPU decode step under load, a first request's warm-up), and
a lapsed lease lets prefill reuse blocks that are still being read.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from transfer.control.client import ClientOptions, TransferClient
from transfer.control.errors import ControlError, GrpcCode
from transfer.control.types import StageRequest, validate_id
from transfer.errors import Closed, InvalidInput

logger = logging.getLogger(__name__)

# A renewal that failed without an answer (deadline passed, peer unreachable) is tried again
# after this share of the interval, not a whole interval later: at three beats per lease, two
# missed beats in a row lost the lease of a transfer still being read (a starved prefill's
# control server, 2026-12-05). A peer that answers (NOT_FOUND: the lease is gone) is not retried.
RENEWAL_RETRY_SHARE = 0.25
_RETRIED_CODES = frozenset({GrpcCode.DEADLINE_EXCEEDED, GrpcCode.UNAVAILABLE})


class PeerOp(enum.Enum):
    HANDSHAKE = "handshake"
    ACQUIRE = "acquire"
    STAGE = "stage"
    HEARTBEAT = "heartbeat"
    RELEASE = "release"
    ABORT = "abort"


@dataclass(frozen=True)
class PeerEvent:
    """The outcome of one call.

    result: HandshakeReply (HANDSHAKE), Ticket (ACQUIRE), the staging offset (STAGE), the new
        lease deadline in unix seconds (HEARTBEAT), None (RELEASE, ABORT, and any failure).
    error: the ControlError the call failed with (its `code` is the gRPC status name), or None.
    tag: whatever the caller passed along with the call.
    """

    op: PeerOp
    address: str
    request_id: str
    result: Any = None
    error: ControlError | None = None
    tag: Any = None

    @property
    def ok(self) -> bool:
        return self.error is None


class PeerClient:
    """Asynchronous control-plane calls to prefill instances, one cached channel per address.

    holder: this decode instance's name, sent with Acquire/Heartbeat/Release/Stage.
    on_event: called (from a pool thread) after each event is queued, e.g. to wake an engine.
    """

    def __init__(
        self,
        holder: str,
        options: ClientOptions | None = None,
        *,
        max_workers: int = 4,
        on_event: Callable[[], None] | None = None,
    ):
        validate_id(holder, "holder")
        self.holder = holder
        self._options = options or ClientOptions()
        self._on_event = on_event
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pdxfer-peer")
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._events: deque[PeerEvent] = deque()
        self._clients: dict[str, TransferClient] = {}
        self._chains: dict[tuple[str, str], deque[tuple[PeerOp, Callable[[], None]]]] = {}
        self._closed = False
        # (address, request id) -> [interval_s, next renewal on time.monotonic(), tag]
        self._kept: dict[tuple[str, str], list[Any]] = {}
        self._beats: threading.Thread | None = None

    # ---- calls ---------------------------------------------------------------------------

    def handshake(
        self,
        address: str,
        instance_id: str,
        compat: Mapping[str, str],
        tag: Any = None,
        timeout_s: float | None = None,
    ) -> None:
        """`timeout_s` shortens the client's deadline for this call."""
        compat = dict(compat)
        self._submit(
            PeerOp.HANDSHAKE,
            address,
            "",
            tag,
            lambda c: c.handshake(instance_id, compat, timeout_s),
        )

    def acquire(self, address: str, request_id: str, tag: Any = None) -> None:
        self._submit(
            PeerOp.ACQUIRE, address, request_id, tag, lambda c: c.acquire(request_id, self.holder)
        )

    def heartbeat(self, address: str, request_id: str, tag: Any = None) -> None:
        self._submit(
            PeerOp.HEARTBEAT,
            address,
            request_id,
            tag,
            lambda c: c.heartbeat(request_id, self.holder),
        )

    def keep_alive(self, address: str, request_id: str, interval_s: float, tag: Any = None) -> None:
        """Heartbeat `request_id` every `interval_s` seconds until `stop_keep_alive`; each
        renewal's outcome arrives as a HEARTBEAT event like any call's."""
        if not interval_s > 0:
            raise InvalidInput(f"interval_s: must be positive, got {interval_s!r}")
        with self._lock:
            if self._closed:
                raise Closed("PeerClient is closed")
            self._kept[(address, request_id)] = [interval_s, time.monotonic() + interval_s, tag]
            if self._beats is None:
                self._beats = threading.Thread(
                    target=self._beat_loop, name="pdxfer-peer-beats", daemon=True
                )
                self._beats.start()
            self._ready.notify_all()

    def next_renewal(self, address: str, request_id: str) -> float | None:
        """When (time.monotonic()) `request_id`'s next renewal is due; None if not kept."""
        with self._lock:
            entry = self._kept.get((address, request_id))
            return None if entry is None else entry[1]

    def stop_keep_alive(self, address: str, request_id: str) -> None:
        """No more renewals of `request_id` (one already submitted still runs)."""
        with self._lock:
            self._kept.pop((address, request_id), None)

    def stage(self, address: str, request: StageRequest, tag: Any = None) -> None:
        if request.holder != self.holder:
            raise InvalidInput(f"request.holder: {request.holder!r} is not {self.holder!r}")
        self._submit(PeerOp.STAGE, address, request.request_id, tag, lambda c: c.stage(request))

    def release(
        self,
        address: str,
        request_id: str,
        block_ids: tuple[int, ...],
        slot_id: int,
        tag: Any = None,
    ) -> None:
        """Done reading; `block_ids`/`slot_id` repeat the acquired ticket's."""
        block_ids = tuple(block_ids)
        self._submit(
            PeerOp.RELEASE,
            address,
            request_id,
            tag,
            lambda c: c.release(request_id, self.holder, block_ids, slot_id),
        )

    def abort(
        self, address: str, request_id: str, abort_key: str, reason: str = "", tag: Any = None
    ) -> None:
        self._submit(
            PeerOp.ABORT,
            address,
            request_id,
            tag,
            lambda c: c.abort(request_id, abort_key, reason),
        )

    # ---- results -------------------------------------------------------------------------

    def drain(self) -> list[PeerEvent]:
        """Every event that arrived since the last drain, in arrival order."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events

    def wait(self, timeout_s: float) -> bool:
        """Block until an event is waiting (True) or `timeout_s` passes (False)."""
        with self._ready:
            return self._ready.wait_for(lambda: bool(self._events) or self._closed, timeout_s)

    def pending(self) -> int:
        """Calls submitted whose event has not arrived yet."""
        with self._lock:
            return sum(len(chain) for chain in self._chains.values())

    def close(self, wait: bool = True) -> None:
        """Stop taking calls; with `wait`, let the submitted ones finish first."""
        with self._lock:
            self._closed = True
            self._ready.notify_all()
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------

    def _beat_loop(self) -> None:
        while True:
            with self._ready:
                if self._closed:
                    return
                now = time.monotonic()
                due = [(key, entry[2]) for key, entry in self._kept.items() if entry[1] <= now]
                for key, _ in due:
                    entry = self._kept[key]
                    entry[1] = now + entry[0]
                if not due:
                    wake = min((entry[1] for entry in self._kept.values()), default=now + 1.0)
                    self._ready.wait(max(wake - now, 0.001))
                    continue
            for (address, request_id), tag in due:
                try:
                    self.heartbeat(address, request_id, tag=tag)
                except Closed:
                    return

    def _submit(
        self,
        op: PeerOp,
        address: str,
        request_id: str,
        tag: Any,
        call: Callable[[TransferClient], Any],
    ) -> None:
        if not isinstance(address, str) or not address:
            raise InvalidInput("address: must be a non-empty 'host:port'")
        key = (address, request_id)

        def run() -> None:
            try:
                result = call(self._client(address))
                event = PeerEvent(op, address, request_id, result=result, tag=tag)
            except ControlError as err:
                event = PeerEvent(op, address, request_id, error=err, tag=tag)
            except Exception as exc:  # a bug or a broken channel: still one event, never lost
                logger.exception("peer call %s to %s failed", op.value, address)
                error = ControlError("INTERNAL", f"{type(exc).__name__}: {exc}")
                event = PeerEvent(op, address, request_id, error=error, tag=tag)
            self._finish(key, event)

        with self._lock:
            if self._closed:
                raise Closed("PeerClient is closed")
            chain = self._chains.setdefault(key, deque())
            chain.append((op, run))
            first = len(chain) == 1
        if first:
            self._pool.submit(run)

    def _finish(self, key: tuple[str, str], event: PeerEvent) -> None:
        with self._lock:
            self._events.append(event)
            kept = self._kept.get(key)
            if kept is not None and event.op is PeerOp.HEARTBEAT and unanswered(event):
                kept[1] = min(kept[1], time.monotonic() + kept[0] * RENEWAL_RETRY_SHARE)
            chain = self._chains[key]
            chain.popleft()
            following = chain[0] if chain else None
            if following is None:
                del self._chains[key]
            self._ready.notify_all()
        if following is not None:
            try:
                self._pool.submit(following[1])
            except RuntimeError:  # closed without waiting: the call is dropped, say so
                self._finish(key, PeerEvent(following[0], key[0], key[1], error=_CLOSED))
        if self._on_event is not None:
            self._on_event()

    def _client(self, address: str) -> TransferClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = TransferClient(
                    address,
                    token=self._options.token,
                    tls=self._options.tls,
                    timeout_s=self._options.timeout_s,
                )
                self._clients[address] = client
            return client


def unanswered(event: PeerEvent) -> bool:
    """The call failed without the peer's answer (deadline passed, peer unreachable): trying
    again may work, unlike a refusal."""
    return event.error is not None and event.error.code in _RETRIED_CODES


_CLOSED = ControlError("CANCELLED", "PeerClient closed before the call ran")
