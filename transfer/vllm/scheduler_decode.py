"""The decode role of the connector's scheduler half: one `Pull` record per request that came
with a pdxfer ticket, moved through its phases on vLLM's scheduler thread.

    ACQUIRING --acquired, handshaken--> ACQUIRED --allocated--> LOADING --finished--> RELEASING
        |                                  |                                          |
        +--failed: LOCAL                   +--aborted / nothing to load: RELEASING   done
        +--ticket differs from prefill's, or handshake failed: RELEASING (vLLM computes it)

Acquire (claim the ticket, renew its lease) and the Handshake with its prefill instance (once
per address, `scheduler_peers`) run before vLLM is told how many tokens it will get, so a dead,
unknown or incompatible prefill costs a recompute, not a failed request, and no worker waits on
the control plane. Heartbeats keep the lease while the workers read; Release goes out once vLLM
reports the load finished (or failed: the workers report the bad blocks and vLLM recomputes them).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transfer.control.peer_client import PeerClient, PeerEvent, PeerOp
from transfer.control.types import Ticket as StoreTicket
from transfer.errors import InvalidInput
from transfer.vllm.metadata import LoadSpec, PrefillPeer
from transfer.vllm.scheduler_groups import TransferGroups
from transfer.vllm.scheduler_peers import PrefillPeers
from transfer.vllm.stats import PdxferStats
from transfer.vllm.ticket import PARAMS_KEY, Ticket

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

LOADED = "_pdxfer_loaded"  # set once the load is ordered: a rescheduled request loads nothing


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


class DecodeSide:
    """Pulls in flight, keyed by the decode request id."""

    def __init__(
        self,
        peers: PeerClient,
        groups: TransferGroups,
        compat: Mapping[str, str],
        *,
        heartbeat_s: float,
        stats: PdxferStats,
        stats_lock: threading.Lock,
    ):
        self._peers = peers
        self._groups = groups
        self._prefills = PrefillPeers(peers, compat)
        self._heartbeat_s = heartbeat_s
        self._stats = stats
        self._stats_lock = stats_lock
        self._pulls: dict[str, Pull] = {}
        self._loads: list[LoadSpec] = []

    def phase(self, request_id: str) -> PullPhase | None:
        pull = self._pulls.get(request_id)
        return None if pull is None else pull.phase

    def on_new_request(self, request: Request) -> None:
        """Start acquiring as soon as vLLM sees the request."""
        self._track(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        pull = self._track(request)
        if pull is None or pull.release_only:
            return 0, False
        self.poll()
        if pull.phase is PullPhase.ACQUIRING:
            return None, False  # ask again next step
        if pull.phase is not PullPhase.ACQUIRED:
            return 0, False
        count = pull.ticket.num_tokens - num_computed_tokens
        if num_computed_tokens > 0 or count <= 0:
            # A local prefix hit: the loaded blocks would not line up with the ticket's.
            return 0, False
        return count, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        pull = self._pulls.get(request.request_id)
        if pull is None or pull.phase is not PullPhase.ACQUIRED:
            return
        if num_external_tokens <= 0:
            self._release(pull)  # vLLM computes it locally after all
            return
        allocated = blocks.get_block_ids()
        block_ids = self._groups.clip(allocated, pull.ticket.num_tokens)
        self._loads.append(
            LoadSpec(
                request_id=request.request_id,
                ticket=pull.ticket,
                block_ids=block_ids,
                num_tokens=pull.ticket.num_tokens,
            )
        )
        pull.phase = PullPhase.LOADING
        logger.debug(
            "request %s: loading %d tokens into blocks %s (of %s) from %s blocks %s",
            request.request_id,
            pull.ticket.num_tokens,
            block_ids,
            allocated,
            pull.ticket.control_address,
            pull.ticket.block_ids,
        )
        request.kv_transfer_params[LOADED] = True

    def take_loads(self) -> tuple[list[LoadSpec], dict[str, PrefillPeer]]:
        """The loads to start this step, and the prefill instances they read that the workers
        have not been told of yet. (Held leases renew on PeerClient's own timer, from Acquire
        until Release, however long a step takes.)"""
        self.poll()
        loads, self._loads = self._loads, []
        return loads, self._prefills.announce(load.ticket.control_address for load in loads)

    def on_finished_recving(
        self, request_ids: set[str], failed_ids: frozenset[str] | set[str] = frozenset()
    ) -> None:
        """The workers are done with these loads, `failed_ids` among them having given up
        (the workers counted those): release prefill either way, so it frees the blocks."""
        for request_id in request_ids | failed_ids:
            pull = self._pulls.get(request_id)
            if pull is not None and pull.phase is PullPhase.LOADING:
                pull.failure_counted = request_id in failed_ids
                self._release(pull)
        self.poll()

    def request_finished(self, request: Request) -> None:
        """vLLM finished the request. A load in flight releases when it reports finished;
        anything earlier releases now (prefill then frees its blocks at once)."""
        pull = self._track(request)  # a request vLLM never showed us still frees prefill
        if pull is None:
            return
        pull.finished = True
        if pull.phase is PullPhase.ACQUIRED:
            self._release(pull)
        elif pull.phase is PullPhase.ACQUIRING:
            self._advance(pull)  # acquired, waiting on the handshake: release now
        elif pull.phase is PullPhase.LOCAL:
            del self._pulls[request.request_id]

    def idle(self) -> bool:
        """No request of this server pulls a cache, nor waits to."""
        return not self._pulls and not self._loads

    def has_calls_in_flight(self) -> bool:
        """An Acquire, Handshake or Release whose answer must still be applied: vLLM must keep stepping
        (an aborted request's release goes out only when its Acquire's answer is seen)."""
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

    # ---- internals -----------------------------------------------------------------------

    def _track(self, request: Request) -> Pull | None:
        pull = self._pulls.get(request.request_id)
        if pull is not None:
            return pull
        params = request.kv_transfer_params
        if not params or PARAMS_KEY not in params or params.get(LOADED):
            return None
        try:
            ticket = Ticket.from_params(params)
        except InvalidInput as exc:
            logger.warning("request %s: ignoring its pdxfer ticket: %s", request.request_id, exc)
            return None
        pull = Pull(request.request_id, ticket)
        if ticket.num_tokens >= request.num_prompt_tokens:
            owner = self._owner(ticket)
            if owner is not None:
                # vLLM's notice that a request never reached the engine (a 1-token prompt,
                # aborted at once: `notify_kv_transfer_request_rejected`) can follow one that
                # did, when the client left while it was being added. The request that reached
                # the engine reads and releases this ticket; releasing it here too would let
                # prefill reuse the blocks while they are read.
                logger.info(
                    "request %s (%s): its pdxfer ticket is request %s's (%s); left to that one",
                    request.request_id,
                    request.status,
                    owner.request_id,
                    owner.phase.value,
                )
                params[LOADED] = True
                return None
            logger.warning(
                "request %s (%s): ticket covers %d tokens of a %d-token prompt; computing "
                "locally and releasing the ticket",
                request.request_id,
                request.status,
                ticket.num_tokens,
                request.num_prompt_tokens,
            )
            pull.release_only = True
            params[LOADED] = True  # once released, the ticket is never tracked again
        else:
            self._prefills.ensure(ticket.control_address)
        self._peers.acquire(ticket.control_address, ticket.request_id, tag=request.request_id)
        self._pulls[request.request_id] = pull
        return pull

    def _owner(self, ticket: Ticket) -> Pull | None:
        """The pull already tracking the same prefill ticket, if any."""
        for pull in self._pulls.values():
            if (pull.ticket.control_address, pull.ticket.request_id) == (
                ticket.control_address,
                ticket.request_id,
            ):
                return pull
        return None

    def _release(self, pull: Pull) -> None:
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
            self._release(pull)
            return
        mismatch = _mismatch(pull.ticket, pull.held, self._groups)
        if mismatch is not None:
            # A forged or stale ticket: reading its blocks could read another request's cache.
            logger.error(
                "request %s: its pdxfer ticket does not match what %s holds for %s (%s); "
                "not reading, computing the prompt locally",
                pull.request_id,
                event.address,
                pull.ticket.request_id,
                mismatch,
            )
            if not pull.failure_counted:
                self._count_failure(pull)
            self._release(pull)  # releasing makes vLLM compute it (no tokens matched)
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
            self._release(pull)
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


def _mismatch(ticket: Ticket, held: StoreTicket, groups: TransferGroups) -> str | None:
    """How the client's ticket differs from the one prefill's TicketStore holds, or None.

    The store keeps the ticket group's block ids and the token count; the other groups' ids
    (a mamba group's state block) are not in it and cannot be checked here."""
    if ticket.num_tokens != held.num_tokens:
        return f"num_tokens {ticket.num_tokens}, prefill holds {held.num_tokens}"
    if len(ticket.block_ids) != len(groups):
        return f"{len(ticket.block_ids)} block groups, this model has {len(groups)}"
    ticket_group = groups.ticket_group
    if tuple(ticket.block_ids[ticket_group]) != tuple(held.block_ids):
        return (
            f"block_ids[{ticket_group}] {list(ticket.block_ids[ticket_group])}, "
            f"prefill holds {list(held.block_ids)}"
        )
    return None


_HANDLERS: dict[PeerOp, Callable[[DecodeSide, Pull, PeerEvent], None]] = {
    PeerOp.ACQUIRE: DecodeSide._on_acquire,
    PeerOp.HEARTBEAT: DecodeSide._on_heartbeat,
    PeerOp.RELEASE: DecodeSide._on_release,
}
