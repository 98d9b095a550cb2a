"""The prefill role of the connector's scheduler half: publish finished prefills, serve
pdxfer's TransferService, and hand the ids decode released (or whose lease lapsed) back to
vLLM so it frees their blocks.

A request sent with `kv_transfer_params: {"do_remote_decode": true}` is cut by its last prompt
token on arrival (decode recomputes it: a recurrent state is not idempotent, docs/bugs.md #12),
so the cache it keeps covers exactly the tokens decode loads. When it finishes, its blocks stay
allocated under a TicketStore lease and its response carries the pdxfer ticket.

A prompt that ends inside an attention block gets a stage slot in the step that computes its
last tokens (`scheduler_stages`); the slot is freed with the ticket.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from transfer.control.server import ControlServer, serve
from transfer.control.tickets import TicketStore
from transfer.control.types import (
    ControlConfig,
    FreeReason,
    HandshakeReply,
    compat_hash,
)
from transfer.control.types import Ticket as StoreTicket
from transfer.errors import InvalidInput
from transfer.vllm.config import PdxferConfig
from transfer.vllm.metadata import DigestSpec, RankHandshake, StageSpec
from transfer.vllm.scheduler_digests import DigestSlots
from transfer.vllm.scheduler_groups import TransferGroups
from transfer.vllm.scheduler_stages import StageSlots
from transfer.vllm.stats import PdxferStats
from transfer.vllm.ticket import Ticket

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

DO_REMOTE_DECODE = "do_remote_decode"
TRUNCATED = "_pdxfer_truncated"  # set once: a preempted, rescheduled request is not cut twice


class PrefillSide:
    """Tickets for finished prefills; the gRPC server starts once the workers registered."""

    def __init__(
        self,
        config: PdxferConfig,
        groups: TransferGroups,
        compat: dict[str, str],
        *,
        instance_id: str,
        num_blocks: int,
        max_model_len: int,
        tp_size: int,
        stats: PdxferStats,
        stats_lock: threading.Lock,
    ):
        self._config = config
        self._groups = groups
        self._compat = compat
        self._instance_id = instance_id
        self._tp_size = tp_size
        self._stats = stats
        self._stats_lock = stats_lock
        control = ControlConfig(
            num_kv_blocks=num_blocks,
            num_state_slots=num_blocks,  # a live ticket holds >= 1 block: never more tickets
            block_size=groups.block_size,
            max_blocks_per_request=max(1, -(-max_model_len // groups.block_size)),
            lease_s=config.lease_s,
        )
        self.store = TicketStore(control, self._on_free, instance_id=instance_id)
        self._lock = threading.Lock()
        self._free_slots = list(range(num_blocks - 1, -1, -1))
        self._released: list[str] = []
        self._server: ControlServer | None = None
        self._stages = StageSlots(groups)
        self._tracked: dict[str, Request] = {}  # truncated prefills not finished yet
        self._block_ids: dict[str, list[list[int]]] = {}  # their block ids per vLLM group
        self._digests = DigestSlots(config.verify)

    @property
    def address(self) -> str | None:
        """The advertised control address, once the server runs."""
        return None if self._server is None else self._server.address

    def start(self, handshakes: dict[int, RankHandshake]) -> None:
        """Serve TransferService with the workers' registrations (one per TP rank)."""
        ranks = sorted(handshakes)
        if ranks != list(range(self._tp_size)):
            raise InvalidInput(
                f"handshake metadata: expected TP ranks 0..{self._tp_size - 1}, got {ranks}"
            )
        identity = HandshakeReply(
            instance_id=self._instance_id,
            compat=self._compat,
            compat_hash=compat_hash(self._compat),
            rank_metadata=tuple(handshakes[r].agent_metadata for r in ranks),
            rank_layouts=tuple(json.dumps(handshakes[r].layout).encode() for r in ranks),
        )
        if self._server is not None:
            raise InvalidInput("handshake metadata: set twice")
        self._stages.start(handshakes)
        self._digests.start(handshakes)
        address = f"{self._config.control_host}:{self._config.control_port}"
        self.store.start()
        self._server = serve(
            address, store=self.store, identity=identity, token=self._config.auth_token
        )
        self.store.address = self._server.address
        logger.info("pdxfer control server for %s on %s", self._instance_id, self.address)

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not params or not params.get(DO_REMOTE_DECODE) or params.get(TRUNCATED):
            return
        if request.num_prompt_tokens < 2 or request.get_skip_reading_prefix_cache():
            return  # nothing to hand over: decode computes the prompt itself
        # vLLM's own truncation of a prefill-only request (its NixlConnector does the same).
        if request.prompt_token_ids is None:
            return
        del request.prompt_token_ids[-1:]
        del request._all_token_ids[-1:]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params[TRUNCATED] = True
        self._tracked[request.request_id] = request

    def plan_stages(self, output: SchedulerOutput) -> list[StageSpec]:
        """The partial last blocks whose tokens this step computes (see the module doc)."""
        for new in output.scheduled_new_reqs:
            if new.req_id in self._tracked:
                self._block_ids[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = output.scheduled_cached_reqs
        for req_id, added in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if req_id not in self._tracked or added is None:
                continue
            if req_id in cached.resumed_req_ids or req_id not in self._block_ids:
                self._block_ids[req_id] = [list(ids) for ids in added]
            else:
                for ids, more in zip(self._block_ids[req_id], added, strict=True):
                    ids.extend(more)
        stages = []
        for req_id, scheduled in output.num_scheduled_tokens.items():
            request = self._tracked.get(req_id)
            if request is None:
                continue
            stage = self._stages.plan(request, scheduled, self._block_ids.get(req_id, []))
            if stage is not None:
                stages.append(stage)
        return stages

    def plan_digests(self, output: SchedulerOutput) -> list[DigestSpec]:
        """Verify: the requests whose last prompt tokens this step computes (after
        `plan_stages`, which records their block ids)."""
        if not self._digests.enabled:
            return []
        specs = []
        for req_id, scheduled in output.num_scheduled_tokens.items():
            request = self._tracked.get(req_id)
            if request is None or req_id not in self._block_ids:
                continue
            if request.num_computed_tokens + scheduled < request.num_prompt_tokens:
                continue
            num_tokens = request.num_prompt_tokens
            clipped = self._groups.clip(self._block_ids.get(req_id, []), num_tokens)
            spec = self._digests.plan(req_id, clipped, num_tokens)
            if spec is not None:
                specs.append(spec)
        return specs

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Publish a finished prefill; True keeps its blocks until decode releases them."""
        self._tracked.pop(request.request_id, None)
        self._block_ids.pop(request.request_id, None)
        stage_slot, staged_offsets = self._stages.take(
            request.request_id, request.num_computed_tokens
        )
        digest_offsets = self._digests.publish(request.request_id, request.num_computed_tokens)
        if stage_slot >= 0:
            # Held before the ticket is live, as the digest slot: a release that comes as soon
            # as it is published finds the slot to free.
            self._stages.hold(request.request_id, stage_slot)
        kept, params = self._publish(request, block_ids, staged_offsets, digest_offsets)
        if not kept:
            self._digests.free(request.request_id)
            self._stages.free(request.request_id)
        return kept, params

    def _publish(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        staged_offsets: tuple[int, ...],
        digest_offsets: tuple[int, ...],
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params or not params.get(DO_REMOTE_DECODE):
            return False, None
        finished = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        num_tokens = request.num_computed_tokens
        if not finished or num_tokens < 1 or not params.get(TRUNCATED):
            return False, None  # aborted, or nothing decode could load
        if self._server is None:
            logger.error("request %s: pdxfer control server not started", request.request_id)
            return False, None
        clipped = self._groups.clip(block_ids, num_tokens)
        logger.debug(
            "request %s: publishing %d tokens in blocks %s (of %s)",
            request.request_id,
            num_tokens,
            clipped,
            block_ids,
        )
        with self._lock:
            if not self._free_slots:
                logger.error("request %s: no ticket slot free", request.request_id)
                return False, None
            slot = self._free_slots.pop()
        try:
            published = self.store.publish(
                request.request_id,
                self._groups.ticket_blocks(clipped),
                slot,
                num_tokens,
                first_token=request.output_token_ids[0] if request.output_token_ids else 0,
            )
        except InvalidInput:
            logger.exception("request %s: not published", request.request_id)
            with self._lock:
                self._free_slots.append(slot)
            return False, None
        ticket = Ticket(
            control_address=published.address,
            request_id=request.request_id,
            block_ids=clipped,
            num_tokens=num_tokens,
            tp_size=self._tp_size,
            compat_hash=compat_hash(self._compat),
            staged_offsets=staged_offsets,
            digest_offsets=digest_offsets,
        )
        # do_remote_prefill / do_remote_decode: the keys vLLM's proxies route on.
        return True, {**ticket.to_params(), "do_remote_prefill": True, DO_REMOTE_DECODE: False}

    def take_released(self) -> list[str]:
        """Ids whose blocks vLLM may free now (each once)."""
        with self._lock:
            released, self._released = self._released, []
        return released

    def has_pending_frees(self) -> bool:
        with self._lock:
            pending = bool(self._released)
        return pending or len(self.store) > 0

    def only_holding(self) -> bool:
        """Tickets wait for decode and nothing was released since the last step."""
        with self._lock:
            released = bool(self._released)
        return not released and len(self.store) > 0

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0.5)
            self._server = None
            self.store.stop()

    def _on_free(self, ticket: StoreTicket, reason: FreeReason) -> None:
        # Called by the TicketStore from a gRPC thread or the lease reaper.
        with self._lock:
            self._released.append(ticket.request_id)
            self._free_slots.append(ticket.slot_id)
            self._stages.free(ticket.request_id)  # with the ticket's slot, as one step
        self._digests.free(ticket.request_id)
        if reason is FreeReason.EXPIRED:
            with self._stats_lock:
                self._stats.record_expired_leases(1)
        logger.debug("request %s freed (%s)", ticket.request_id, reason.value)
