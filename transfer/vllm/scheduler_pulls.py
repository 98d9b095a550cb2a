"""Decode's pulls: one `Pull` record per request that came with a pdxfer ticket, moved
through its phases by vLLM's hooks (`scheduler_decode`) and the `PeerClient`'s answers.

    ACQUIRING --acquired, handshaken--> ACQUIRED --allocated--> LOADING --finished--> RELEASING
        |                                  |                                          |
        +--failed: LOCAL                   +--aborted / nothing to load: RELEASING   done
        +--ticket differs from prefill's, or handshake failed: RELEASING (vLLM computes it)

Acquire (claim the ticket, renew its lease) and the Handshake with its prefill instance (once
per address, `scheduler_peers`) are answered before vLLM is told how many tokens it will
get. Heartbeats keep the lease while the workers read; Release goes out once vLLM reports
the load finished (or failed: the workers report the bad blocks and vLLM recomputes them).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from transfer.control.peer_client import PeerClient, PeerEvent, PeerOp
from transfer.control.types import Ticket as StoreTicket
from transfer.vllm.scheduler_groups import TransferGroups
from transfer.vllm.scheduler_peers import PrefillPeers
from transfer.vllm.scheduler_ticket_checks import mismatch
from transfer.vllm.stats import PdxferStats
from transfer.vllm.ticket import Ticket

logger = logging.getLogger(__name__)


class PullPhase(enum.Enum):
    ACQUIRING = "acquiring"
    ACQUIRED = "acquired"
    LOADING = "loading"
    RELEASING = "releasing"
    LOCAL = "local"  # no remote cache: vLLM computes the prompt here


@dataclass
class Pull:
    """One decode request whose cache comes from a prefill instance."""

    request_id: str
    ticket: Ticket
    phase: PullPhase = PullPhase.ACQUIRING
    held: StoreTicket | None = None  # the acquired store ticket: what Release must repeat
    finished: bool = False  # vLLM finished the request (e.g. aborted) before it loaded
    failure_counted: bool = False  # a failed load (the workers count it) or a refused ticket
    handshake_failed: bool = False  # its prefill's Handshake failed: never read, only released
    # The ticket cannot serve this request (it covers the whole prompt): acquired only to be
    # released, so prefill frees its blocks now rather than at lease expiry.
    release_only: bool = False


class Pulls:
    """Pulls in flight, keyed by the decode request id."""

    def __init__(
        self,
        peers: PeerClient,
        prefills: PrefillPeers,
        groups: TransferGroups,
        *,
        heartbeat_s: float,
        stats: PdxferStats,
        stats_lock: threading.Lock,
    ):
        self._peers = peers
        self._prefills = prefills
        self._groups = groups
        self._heartbeat_s = heartbeat_s
        self._stats = stats
        self._stats_lock = stats_lock
        self._pulls: dict[str, Pull] = {}

    def get(self, request_id: str) -> Pull | None:
        return self._pulls.get(request_id)

    def __bool__(self) -> bool:
        return bool(self._pulls)

    def start(self, request_id: str, ticket: Ticket, *, release_only: bool) -> Pull:
        """Acquire the ticket, and handshake with its prefill unless it is only released."""
        pull = Pull(request_id, ticket, release_only=release_only)
        if not release_only:
            self._prefills.ensure(ticket.control_address)
        self._peers.acquire(ticket.control_address, ticket.request_id, tag=request_id)
        self._pulls[request_id] = pull
        return pull

    def owner(self, ticket: Ticket) -> Pull | None:
        """The pull already tracking the same prefill ticket, if any."""
        for pull in self._pulls.values():
            if (pull.ticket.control_address, pull.ticket.request_id) == (
                ticket.control_address,
                ticket.request_id,
            ):
                return pull
        return None

    def has_calls_in_flight(self) -> bool:
        """An Acquire, Handshake or Release whose answer must still be applied."""
        return any(
            p.phase in (PullPhase.ACQUIRING, PullPhase.RELEASING) for p in self._pulls.values()
        )

    def poll(self) -> None:
        """Apply every PeerClient event that arrived."""
        for event in self._peers.drain():
            if event.op is PeerOp.HANDSHAKE:
                self._on_handshake(event)
                continue
            pull = self._pulls.get(event.tag) if isinstance(event.tag, str) else None
            if pull is None:
                continue
            handler = _HANDLERS.get(event.op)
            if handler is not None:
                handler(self, pull, event)

    def loading(self, pull: Pull) -> None:
        """vLLM allocated the pull's blocks and its load is ordered."""
        pull.phase = PullPhase.LOADING

    def loaded(self, pull: Pull, failed: bool) -> None:
        """The workers are done with the pull's load (`failed`: they gave up and counted it)."""
        if pull.phase is PullPhase.LOADING:
            pull.failure_counted = failed
            self.release(pull)

    def finish(self, pull: Pull) -> None:
        """vLLM finished the request: anything before LOADING releases now."""
        pull.finished = True
        if pull.phase is PullPhase.ACQUIRED:
            self.release(pull)
        elif pull.phase is PullPhase.ACQUIRING:
            self._advance(pull)  # acquired, waiting on the handshake: release now
        elif pull.phase is PullPhase.LOCAL:
            del self._pulls[pull.request_id]

    def release(self, pull: Pull) -> None:
        assert pull.held is not None
        pull.phase = PullPhase.RELEASING
        self._peers.stop_keep_alive(pull.ticket.control_address, pull.ticket.request_id)
        self._peers.release(
            pull.ticket.control_address,
            pull.ticket.request_id,
            pull.held.block_ids,
            pull.held.slot_id,
            tag=pull.request_id,
        )

    # ---- PeerClient's answers ------------------------------------------------------------

    def _on_acquire(self, pull: Pull, event: PeerEvent) -> None:
        if pull.phase is not PullPhase.ACQUIRING:
            return
        if not event.ok:
            if pull.release_only:  # nothing was to be read: not a failure
                logger.info("request %s: its unused ticket is gone already (%s)",
                            pull.request_id, event.error)  # fmt: skip
            elif not pull.failure_counted:  # else its handshake failed: counted then
                logger.warning(
                    "request %s: acquiring its cache from %s failed (%s); computing it locally",
                    pull.request_id,
                    event.address,
                    event.error,
                )
                self._count_failure(pull)
            pull.phase = PullPhase.LOCAL
            if pull.finished:
                del self._pulls[pull.request_id]
            return
        pull.held = event.result
        if pull.release_only:
            self.release(pull)
            return
        differs = mismatch(pull.ticket, pull.held, self._groups)
        if differs is not None:
            # A forged or stale ticket: reading its blocks could read another request's cache.
            logger.error(
                "request %s: its pdxfer ticket does not match what %s holds for %s (%s); "
                "not reading, computing the prompt locally",
                pull.request_id,
                event.address,
                pull.ticket.request_id,
                differs,
            )
            if not pull.failure_counted:
                self._count_failure(pull)
            self.release(pull)  # releasing makes vLLM compute it (no tokens matched)
            return
        self._advance(pull)
        if pull.phase is not PullPhase.RELEASING:  # held until Release, however long that takes
            self._peers.keep_alive(
                event.address, pull.ticket.request_id, self._heartbeat_s, tag=pull.request_id
            )

    def _on_handshake(self, event: PeerEvent) -> None:
        error = self._prefills.on_handshake(event)
        waiting = [
            pull
            for pull in self._pulls.values()
            if pull.phase is PullPhase.ACQUIRING
            and not pull.release_only
            and pull.ticket.control_address == event.address
        ]
        if error is not None:
            logger.warning(
                "handshake with %s failed (%s); %d request(s) compute their prompt locally",
                event.address,
                error,
                len(waiting),
            )
        for pull in waiting:
            if error is not None:
                pull.handshake_failed = True
                if not pull.failure_counted:
                    self._count_failure(pull)
            self._advance(pull)

    def _advance(self, pull: Pull) -> None:
        """An ACQUIRING pull whose Acquire answered moves on once its prefill's Handshake did:
        to ACQUIRED, or -- finished meanwhile, or the handshake failed -- to RELEASING."""
        if pull.phase is not PullPhase.ACQUIRING or pull.held is None:
            return
        if pull.finished or pull.handshake_failed:
            self.release(pull)
        elif self._prefills.ready(pull.ticket.control_address):
            pull.phase = PullPhase.ACQUIRED

    def _count_failure(self, pull: Pull) -> None:
        pull.failure_counted = True
        with self._stats_lock:
            self._stats.record_failed_transfer()

    def _on_heartbeat(self, pull: Pull, event: PeerEvent) -> None:
        if not event.ok:
            logger.warning(
                "request %s: lease renewal at %s failed (%s)",
                pull.request_id,
                event.address,
                event.error,
            )

    def _on_release(self, pull: Pull, event: PeerEvent) -> None:
        del self._pulls[pull.request_id]
        if event.ok:
            return
        if pull.failure_counted:  # prefill gone, most likely: counted already
            logger.warning(
                "request %s: release at %s after a counted failure: %s",
                pull.request_id,
                event.address,
                event.error,
            )
            return
        # NOT_FOUND: the lease lapsed before Release, so prefill may have reused the blocks
        # while they were read. Counted; the tokens may be wrong.
        logger.error(
            "request %s: release at %s failed (%s)", pull.request_id, event.address, event.error
        )
        with self._stats_lock:
            self._stats.record_failed_transfer()


_HANDLERS: dict[PeerOp, Callable[[Pulls, Pull, PeerEvent], None]] = {
    PeerOp.ACQUIRE: Pulls._on_acquire,
    PeerOp.HEARTBEAT: Pulls._on_heartbeat,
    PeerOp.RELEASE: Pulls._on_release,
}
