"""The decode role of the connector's scheduler half: vLLM's scheduler hooks for requests
that came with a pdxfer ticket, on vLLM's scheduler thread. Each such request is a `Pull`
(`scheduler_pulls`: its phases, and the control-plane calls that move it).

Acquire and the Handshake with its prefill instance are answered before vLLM is told how many
tokens it will get, so a dead, unknown or incompatible prefill costs a recompute, not a failed
request, and no worker waits on the control plane.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from transfer.control.peer_client import PeerClient
from transfer.vllm.metadata import LoadSpec, PrefillPeer
from transfer.vllm.scheduler_groups import TransferGroups
from transfer.vllm.scheduler_peers import PrefillPeers
from transfer.vllm.scheduler_pulls import Pull, PullPhase, Pulls
from transfer.vllm.scheduler_ticket_checks import mark_loaded, request_ticket
from transfer.vllm.stats import PdxferStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class DecodeSide:
    """vLLM's decode hooks over the pulls in flight."""

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
        self._groups = groups
        self._prefills = PrefillPeers(peers, compat)
        self._pulls = Pulls(
            peers,
            self._prefills,
            groups,
            heartbeat_s=heartbeat_s,
            stats=stats,
            stats_lock=stats_lock,
        )
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
            self._pulls.release(pull)  # vLLM computes it locally after all
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
        self._pulls.loading(pull)
        logger.debug(
            "request %s: loading %d tokens into blocks %s (of %s) from %s blocks %s",
            request.request_id,
            pull.ticket.num_tokens,
            block_ids,
            allocated,
            pull.ticket.control_address,
            pull.ticket.block_ids,
        )
        mark_loaded(request)

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
            if pull is not None:
                self._pulls.loaded(pull, failed=request_id in failed_ids)
        self.poll()

    def request_finished(self, request: Request) -> None:
        """vLLM finished the request. A load in flight releases when it reports finished;
        anything earlier releases now (prefill then frees its blocks at once)."""
        pull = self._track(request)  # a request vLLM never showed us still frees prefill
        if pull is not None:
            self._pulls.finish(pull)

    def idle(self) -> bool:
        """No request of this server pulls a cache, nor waits to."""
        return not self._pulls and not self._loads

    def has_calls_in_flight(self) -> bool:
        """An Acquire, Handshake or Release whose answer must still be applied: vLLM must keep
        stepping (an aborted request's release goes out only when its Acquire's answer is
        seen)."""
        return self._pulls.has_calls_in_flight()

    def poll(self) -> None:
        """Apply every PeerClient event that arrived."""
        self._pulls.poll()

    def _track(self, request: Request) -> Pull | None:
        pull = self._pulls.get(request.request_id)
        if pull is not None:
            return pull
        ticket = request_ticket(request)
        if ticket is None:
            return None
        release_only = ticket.num_tokens >= request.num_prompt_tokens
        if release_only:
            owner = self._pulls.owner(ticket)
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
                mark_loaded(request)
                return None
            logger.warning(
                "request %s (%s): ticket covers %d tokens of a %d-token prompt; computing "
                "locally and releasing the ticket",
                request.request_id,
                request.status,
                ticket.num_tokens,
                request.num_prompt_tokens,
            )
            mark_loaded(request)  # once released, the ticket is never tracked again
        return self._pulls.start(request.request_id, ticket, release_only=release_only)
