"""What a decode request goes through before it runs, on the engine thread: its prefill
instance handshaken (once per instance; decode_handshakes), its ticket Acquired, room in the
cache, its READs planned (direct READs on the engine thread; a staged transfer plans and
stages off it; a stream plans as the prefill publishes progress), the transfer started and,
once DONE, its ticket Released and token 0 sent. Every call to a prefill instance goes
through PeerClient: its answer comes back as an event (`on_event`), never blocking the loop.

A whole transfer that reads directly does not wait for its Acquire: it is admitted, planned
and started from the ticket the router passed, while the Acquire is out, and counts as DONE
only once the Acquire has answered with that same ticket (same publish: its abort key, blocks
and slot). That is safe because prefill holds a published cache until a Release, an Abort or
the lease's end, and a freed ticket never comes back under its abort key: an Acquire, then a
Release, that both succeed on it prove the cache was held from the ticket's publish, before
any READ, to the Release, after the last. A transfer that would stage waits for the Acquire
(a Stage must come from the ticket's holder); so do streams and the heartbeats."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from transfer.control.client import ClientOptions
from transfer.control.errors import NotPermitted, TicketStateError
from transfer.control.peer_client import PeerEvent, PeerOp
from transfer.control.types import TokenEvent
from transfer.errors import InvalidInput, PdxferError
from transfer.serving.engine.decode_handshakes import Handshakes
from transfer.serving.engine.peers import Peer, PeerTable, unreachable
from transfer.serving.engine.reads import Reads, may_stage, plan_reads, transfer_request
from transfer.serving.engine.request import DecodePhase, Request
from transfer.serving.engine.stream import StreamPlanner, progress_entries
from transfer.serving.engine.transfers import STREAM_HEARTBEAT_S, Outcome, Transfer
from transfer.serving.ranks.commands import Snapshot, StreamSource
from transfer.serving.ranks.progress import TransferMode
from transfer.serving.ranks.spec import RankReads
from transfer.serving.role import ServeRole
from transfer.trace import TracePoint, mark

if TYPE_CHECKING:
    from transfer.serving.engine.decode_engine import DecodeEngine

logger = logging.getLogger(__name__)


class DecodeSetup:
    def __init__(self, engine: DecodeEngine, options: ClientOptions, known_prefill=()) -> None:
        self.engine = engine
        self.instance = engine.instance
        self.options = options
        self.peers = PeerTable(known_prefill)
        self.handshakes = Handshakes(self)

    @staticmethod
    def busy(request: Request) -> bool:
        """Whether an answer for `request` must come back before it may end."""
        return request.waiting_on > 0

    # -- acquire --------------------------------------------------------------------------

    def start(self, request: Request) -> None:
        ticket = request.decode.ticket
        try:
            if not ticket.address:
                raise InvalidInput("ticket.address: the prefill instance's address is required")
            self.peers.check_known(ticket.address)
        except (InvalidInput, NotPermitted) as exc:
            self.engine.finish(request, exc)
            return
        peer = self.peers.get(ticket.address, ticket.instance_id)
        if peer is None:
            self.handshakes.acquire_when_handshaken(request, ticket.address)
        else:
            self.acquire(request, peer)

    def acquire(self, request: Request, peer: Peer) -> None:
        """Acquire its ticket from the handshaken `peer`."""
        request.peer = peer
        request.waiting_on += 1
        self.engine.peer_client.acquire(peer.address, request.request_id, tag=request)
        if not request.decode.ticket.stream_key:
            request.ticket = request.decode.ticket  # READs may start before the Acquire answers
            self.admit(request)

    def _acquired(self, request: Request, event: PeerEvent) -> None:
        request.waiting_on -= 1
        if not event.ok:
            if unreachable(event.error):
                self.peers.forget(event.address)
            self.engine.finish(request, event.error)
            return
        mark(TracePoint.ACQUIRE_ANSWERED, request.request_id)
        ticket, early = event.result, request.ticket
        request.ticket, request.ticket_open = ticket, True
        if early is not None and not early.same_publish(ticket):
            # Its READs may have begun from the router's copy, whose cache was freed.
            self.engine.finish(request, TicketStateError(
                f"request {request.request_id!r}: the ticket acquired is not the one passed "
                "(freed and published again)"))  # fmt: skip
            return
        request.acquired = True
        if self.engine.is_ending(request):
            self.end_ticket(request)  # it ended while the Acquire was out
            return
        if request.slot < 0:  # not admitted yet (or still waiting for room)
            request.phase = DecodePhase.ACQUIRED
            self.admit(request)
        elif request.transfer is None:  # admitted, but it would stage: plan it now
            self._plan(request)
        else:
            self._keep_alive(request)
            if request.transfer.outcome is Outcome.DONE:
                self.transferred(request)

    # -- room and the transfer ------------------------------------------------------------

    def admit(self, request: Request) -> None:
        """Room for the whole generation; then plan its READs."""
        ticket, engine = request.ticket, self.engine
        total = ticket.num_tokens + request.max_tokens - 1  # the last token is never fed back
        try:
            admitted = engine.cache.admit(request, total)
        except (PdxferError, ValueError) as exc:  # full, too long, or held under its id
            self.end_ticket(request, f"decode {engine.instance_id}: {exc}")
            engine.finish(request, exc)
            return
        prefix = self.instance.prefix
        if prefix is not None and engine.metrics is not None and ticket.block_hashes:
            engine.metrics.record_prefix(prefix.counts())
        if admitted:
            self._plan(request)

    def _plan(self, request: Request) -> None:
        ticket, peer, instance = request.ticket, request.peer, self.instance
        request.prompt_blocks = request.blocks[: instance.layouts[0].blocks_for(ticket.num_tokens)]
        treq = transfer_request(ticket, request.prompt_blocks, request.slot)
        reused = request.held_prefix * instance.block_size
        new_blocks = request.prompt_blocks[request.held_prefix :]
        if ticket.stream_key:
            whole = instance.config.transfer_mode is TransferMode.WHOLE
            planner = StreamPlanner(peer.layouts, instance.layouts, treq, ticket.stream_key,
                                    reused_tokens=reused, whole=whole)  # fmt: skip
            source = StreamSource(progress_entries(peer.layouts, ticket.slot_id))
            no_reads = tuple(RankReads(()) for _ in instance.layouts)
            self._start_transfer(request, Transfer(peer, no_reads, new_blocks, planner=planner,
                                                   source=source))  # fmt: skip
            return
        config = instance.config
        if not request.acquired:
            # Direct READs only (a Stage must wait for the Acquire): pure CPU, planned on
            # this thread, where a planner thread would only contend with it for the GIL.
            try:
                reads = plan_reads(peer.layouts, instance.layouts, treq, reused_tokens=reused)
            except Exception as exc:  # noqa: BLE001 - layouts the packer cannot pair
                self.engine.finish(request, exc)
                return
            if not may_stage(
                peer.layouts, instance.layouts, reads, instance.staging, config.staging_min_packed
            ):  # else planned once acquired
                self._start_reads(request, reads, new_blocks)
            return
        request.waiting_on += 1
        future = self.engine.plan_off_thread(
            lambda: plan_reads(
                peer.layouts,
                instance.layouts,
                treq,
                request_id=ticket.request_id,
                holder=self.engine.instance_id,
                stager=peer.client,
                pool=instance.staging,
                min_small_ranges=config.staging_min_ranges,
                min_packed=config.staging_min_packed,
                reused_tokens=reused,
            )  # fmt: skip
        )
        future.add_done_callback(
            lambda f: self.engine.call_soon_quietly(lambda: self._planned(request, f, new_blocks))
        )

    def _planned(self, request: Request, future: Future, blocks: tuple[int, ...]) -> None:
        request.waiting_on -= 1
        try:
            reads = future.result()
        except Exception as exc:  # noqa: BLE001 - e.g. the Stage call failed
            self.engine.finish(request, exc)
            return
        if self.engine.is_ending(request) or request.cancelled:
            return  # `_advance` ends a cancelled one; its staging goes with its cache
        self._start_reads(request, reads, blocks)

    def _start_reads(self, request: Request, reads: Reads, blocks: tuple[int, ...]) -> None:
        ticket = request.ticket
        transfer = Transfer(request.peer, reads.per_rank, blocks, reads.kv_bytes,
                            reads.state_bytes, reads.descriptors, ticket.first_token,
                            ticket.first_logprob)  # fmt: skip
        self._start_transfer(request, transfer)

    def _start_transfer(self, request: Request, transfer: Transfer) -> None:
        engine = self.engine
        request.transfer, request.phase = transfer, DecodePhase.TRANSFERRING
        mark(TracePoint.TRANSFER_STARTED, request.request_id)
        request.transfer_started = True
        command = transfer.start(request.request_id, request.slot, engine.transfer_deadline_s)
        engine.add_command(command, lambda answer: engine.transfers.on_poll(request, answer))
        if request.acquired:  # else once the Acquire answers: only the holder may renew
            self._keep_alive(request)

    def _keep_alive(self, request: Request) -> None:
        engine, ticket, transfer = self.engine, request.ticket, request.transfer
        every = engine.heartbeat_s or max(0.2, (ticket.lease_deadline - time.time()) / 3)
        if transfer.planner is not None:
            every = min(every, STREAM_HEARTBEAT_S)
        engine.peer_client.keep_alive(transfer.peer.address, request.request_id, every,
                                      tag=request)  # fmt: skip

    def transferred(self, request: Request) -> None:
        """Its transfer is DONE: every READ landed and was unpacked. Release the ticket; the
        request runs once prefill has it back."""
        if not request.acquired:
            return  # the Acquire's answer calls this again
        engine, ticket, transfer = self.engine, request.ticket, request.transfer
        request.exposed_s = transfer.exposed_s(request.arrived)
        if engine.metrics is not None:
            moved = {"kv": transfer.kv_bytes, "state": transfer.state_bytes}
            engine.metrics.record_transfer("done", transfer.seconds, moved,
                                           transfer.descriptors, request.exposed_s)  # fmt: skip
        self.instance.staging.free(request.request_id)
        if self.instance.prefix is not None:
            self.instance.prefix.insert_prompt(ticket.block_hashes, request.prompt_blocks,
                                               request.held_prefix)  # fmt: skip
        if self.instance.config.dump_dir:
            engine.add_command(Snapshot(request.request_id, ServeRole.DECODE, request.blocks,
                                        request.slot, ticket.num_tokens))  # fmt: skip
        engine.peer_client.stop_keep_alive(transfer.peer.address, request.request_id)
        request.ticket_open = False
        request.waiting_on += 1
        engine.peer_client.release(transfer.peer.address, request.request_id, ticket.block_ids,
                                   ticket.slot_id, tag=request)  # fmt: skip

    def _released(self, request: Request, event: PeerEvent) -> None:
        request.waiting_on -= 1
        engine = self.engine
        if not event.ok:
            request.ticket_open = True  # not released: abort it
            engine.finish(request, event.error)
            return
        if engine.is_ending(request) or request.cancelled:
            return
        ticket, transfer = request.ticket, request.transfer
        request.last_token = transfer.first_token
        mark(TracePoint.FIRST_TOKEN, request.request_id)
        engine.emit(request, TokenEvent(
            request.request_id, transfer.first_token, 0, finished=request.max_tokens == 1,
            ttft_ms=(time.perf_counter() - request.arrived) * 1e3,
            transfer_ms=transfer.seconds * 1e3, kv_bytes=transfer.kv_bytes,
            state_bytes=transfer.state_bytes, descriptors=transfer.descriptors,
            logprob=transfer.first_logprob, cached_prompt_tokens=ticket.cached_tokens,
            reused_decode_tokens=request.held_prefix * self.instance.block_size,
            exposed_transfer_ms=request.exposed_s * 1e3,
        ))  # fmt: skip
        if request.max_tokens == 1:
            engine.finish(request, None)
        else:
            request.phase = DecodePhase.RUNNING

    # -- the end --------------------------------------------------------------------------

    def end_ticket(self, request: Request, reason: str = "") -> None:
        """Stop renewing its lease, and Abort its ticket if it is still ours."""
        engine = self.engine
        if request.transfer is not None:
            engine.peer_client.stop_keep_alive(request.transfer.peer.address, request.request_id)
        if not request.ticket_open:
            return
        request.ticket_open = False
        request.waiting_on += 1
        reason = reason or f"decode {engine.instance_id} dropped the request"
        engine.peer_client.abort(request.peer.address, request.request_id,
                                 request.ticket.abort_key, reason, tag=request)  # fmt: skip

    def on_event(self, event: PeerEvent) -> None:
        request = event.tag
        if event.op is PeerOp.HANDSHAKE:
            self.handshakes.handshaken(event)
        elif event.op is PeerOp.ACQUIRE:
            self._acquired(request, event)
        elif event.op is PeerOp.RELEASE:
            self._released(request, event)
        elif event.op is PeerOp.ABORT:
            request.waiting_on -= 1
            if not event.ok:
                logger.info("abort of %r at %s: %s", request.request_id, event.address,
                            event.error)  # fmt: skip
        elif event.op is PeerOp.HEARTBEAT and not event.ok:
            self.engine.transfers.heartbeat_failed(request, event.error)
