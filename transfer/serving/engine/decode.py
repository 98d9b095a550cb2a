"""Decode instance: pull a ticket's cache from its prefill instance, then stream tokens.

Per request: handshake once per prefill instance (cached), Acquire the ticket, allocate
blocks for the whole generation and a slot (all or nothing), plan each rank's READs with
the packer (asking the prefill instance to pack many small ranges into staging first:
`reads.py`), post them (slot FILLING), poll until every rank is DONE (slot READY; the lease
is heartbeated meanwhile), Release the ticket, then decode step by step from the
transferred state. Any failure Aborts the ticket and frees everything taken here.

A streamed ticket (layer-wise, `stream_key`) arrives before its prefill has run: the READs
are planned part by part as the prefill ranks publish them (`stream.py`), never staged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from transfer.cache.layout import Layout
from transfer.control.client import ClientOptions, TransferClient
from transfer.control.errors import ControlError, GrpcCode, NotPermitted
from transfer.control.metrics import WorkerMetrics
from transfer.control.types import DecodeRequest, Ticket, TokenEvent
from transfer.errors import (
    InvalidInput,
    PdxferError,
    PeerUnavailable,
    TransferFailed,
)
from transfer.serving.addresses import resolve
from transfer.serving.engine.decode_batcher import DecodeBatcher
from transfer.serving.engine.instance import Instance
from transfer.serving.engine.reads import plan_reads, transfer_request
from transfer.serving.engine.stream import StreamPlanner, progress_entries
from transfer.serving.ranks.commands import (
    AddPeers,
    DecodeStep,
    Release,
    Snapshot,
    StreamSource,
    TransferEnd,
    TransferPoll,
    TransferPost,
    TransferSettled,
    TransferStart,
    TransferState,
)
from transfer.serving.ranks.progress import TransferMode
from transfer.serving.ranks.rank_protocol import RankCommandError
from transfer.serving.ranks.spec import RankReads
from transfer.serving.role import ServeRole

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.0005
HANDSHAKE_TIMEOUT_S = 10.0
ACQUIRED_WAIT_S = 5.0  # longest wait for room while holding a ticket
SETTLE_POLL_S = 0.5  # how often held caches of failed transfers are checked
STREAM_HEARTBEAT_S = 0.5  # a stream's heartbeats also notice a failed prefill this soon
# A stream polls this often until its prefill has finished: each poll is a rank command and
# a progress READ, and on a shared CPU they slow the prefill they wait for.
STREAM_POLL_S = 0.002


@dataclass(frozen=True)
class Pulled:
    """A finished transfer into this instance."""

    seconds: float  # posting to done, the slowest rank
    exposed_s: float  # what TTFT saw: from prefill finishing (a stream) or the ticket's
    # arrival (a whole transfer, which plans, stages and reads only then) to done
    kv_bytes: int
    state_bytes: int
    descriptors: int
    first_token: int  # a stream learns it from the prefill ranks' progress
    first_logprob: float


@dataclass(frozen=True)
class Peer:
    """A prefill instance this decode instance has handshaken with."""

    instance_id: str
    address: str
    layouts: tuple[Layout, ...]
    client: TransferClient


class DecodeWorker:
    """Serves `Decode` for one decode instance."""

    def __init__(
        self,
        instance: Instance,
        instance_id: str,
        options: ClientOptions | None = None,
        metrics: WorkerMetrics | None = None,
        transfer_deadline_s: float = 60.0,
        known_prefill: Iterable[str] = (),
    ) -> None:
        self.instance = instance
        self.instance_id = instance_id
        self.options = options or ClientOptions(timeout_s=30.0)
        self.metrics = metrics
        self.transfer_deadline_s = transfer_deadline_s
        self.heartbeat_s: float | None = None  # None: a third of the lease
        self._peers: dict[str, Peer] = {}
        self._peer_lock = threading.Lock()  # never held across a call
        self._known: set[str] = set()
        self.register_prefill(known_prefill)
        # request id -> slot whose blocks a failed READ may still write: freed once settled.
        self._quarantine: dict[str, int] = {}
        self._quarantine_lock = threading.Lock()
        self._closed = threading.Event()
        self._reaper: threading.Thread | None = None
        self.batcher = DecodeBatcher(instance.ranks, instance.config.max_seqs, metrics)
        if metrics is not None:
            metrics.track_requests(
                running=lambda: self.batcher.num_running,
                waiting=lambda: instance.admission.waiting,
            )
            staging = instance.staging
            metrics.track_staging(free=lambda: staging.free_bytes, total=staging.capacity_bytes)

    # -- handshake ------------------------------------------------------------------------

    def register_prefill(self, addresses: Iterable[str]) -> None:
        """Prefill instances (HOST:PORT) this instance may dial, besides `known_prefill`."""
        resolved = [ip for address in addresses for ip in resolve(address)]
        with self._peer_lock:
            self._known.update(resolved)

    def _check_known(self, address: str) -> None:
        with self._peer_lock:
            known = set(self._known)
        if address in known or known.intersection(resolve(address)):
            return
        raise NotPermitted(
            f"ticket.address: {address!r} is not a known prefill instance "
            "(decode --prefill-peers, or registered by the router)"
        )

    def peer(self, address: str, instance_id: str = "") -> Peer:
        """The handshaken prefill instance at `address` (again if it restarted as another:
        instance ids carry a boot id). Only known addresses are dialled, and no lock is held
        across the handshake, so a peer that never answers holds up only its own requests."""
        self._check_known(address)
        with self._peer_lock:
            peer = self._peers.get(address)
        if peer is not None and (not instance_id or peer.instance_id == instance_id):
            return peer
        client = TransferClient(
            address,
            token=self.options.token,
            tls=self.options.tls,
            timeout_s=min(self.options.timeout_s, HANDSHAKE_TIMEOUT_S),
        )
        try:
            reply = client.handshake(self.instance_id, self.instance.compat)
            layouts = tuple(Layout.from_dict(json.loads(b)) for b in reply.rank_layouts)
            staging = tuple(layout.staging_offset for layout in layouts)
            metadata = tuple(reply.rank_metadata)
            self.instance.ranks.call(AddPeers(reply.instance_id, metadata, staging))
        except RankCommandError as exc:
            client.close()
            raise PeerUnavailable(f"connecting to {address}: {exc}") from None
        except BaseException:
            client.close()
            raise
        peer = Peer(reply.instance_id, address, layouts, client)
        with self._peer_lock:
            self._peers[address] = peer
        logger.info("handshake with %s (%s): tp %d", reply.instance_id, address, len(layouts))
        return peer

    def forget(self, address: str) -> None:
        """Handshake again next time (the peer may have restarted). Requests still using the
        old `Peer` keep its client; the channel closes when the last of them lets go."""
        with self._peer_lock:
            self._peers.pop(address, None)

    # -- decode ---------------------------------------------------------------------------

    def decode(self, request: DecodeRequest) -> Iterator[TokenEvent]:
        """Transfer the ticket's cache, then stream `max_tokens` tokens (the ticket's first
        token is event 0; it carries the timings and transfer figures)."""
        start = time.perf_counter()
        ticket = request.ticket
        if not ticket.address:
            raise InvalidInput("ticket.address: the prefill instance's address is required")
        try:
            peer = self.peer(ticket.address, ticket.instance_id)
            ticket = peer.client.acquire(ticket.request_id, self.instance_id)
        except (ControlError, PeerUnavailable) as exc:
            if _unreachable(exc):
                self.forget(request.ticket.address)
            raise
        rid, ranks = ticket.request_id, self.instance.ranks
        total = ticket.num_tokens + request.max_tokens - 1  # the last token is never fed back
        prefix, held = self.instance.prefix, ()
        try:
            with self._quarantine_lock:
                if rid in self._quarantine:  # a retry under its id, while the last one's holds
                    raise TransferFailed(
                        f"request_id {rid!r}: an earlier transfer under this id may still "
                        "move bytes, and its cache is held until it settles",
                        settled=True,  # this attempt posted nothing
                    )
            if prefix is not None and ticket.block_hashes:
                # the state always crosses whole, so every full prompt block counts
                held = prefix.match(ticket.block_hashes, ticket.num_tokens, rid, False).block_ids
                if self.metrics is not None:
                    self.metrics.record_prefix(prefix.counts())
            # Short: the ticket's lease runs meanwhile, and prefill holds its cache for us.
            cache = self.instance.admission.allocate(
                rid, total, wait_s=ACQUIRED_WAIT_S, prefix_blocks=held
            )
        except (PdxferError, ValueError) as exc:  # full (CapacityError) or too long
            if held:
                self.instance.pools.blocks.free_request(rid)
            self._abort(peer, ticket, f"decode {self.instance_id}: {exc}")
            raise
        blocks, slot = tuple(cache.block_ids), cache.slot_ids[0]
        released = False
        try:
            prompt_blocks = blocks[: self.instance.layouts[0].blocks_for(ticket.num_tokens)]
            reused = len(held) * self.instance.block_size
            pulled = self._pull(peer, ticket, prompt_blocks, len(held), slot, reused, start)
            if self.metrics is not None:
                moved = {"kv": pulled.kv_bytes, "state": pulled.state_bytes}
                self.metrics.record_transfer(
                    "done", pulled.seconds, moved, pulled.descriptors, pulled.exposed_s
                )
            self.instance.staging.free(rid)  # every READ landed and was unpacked
            if prefix is not None:
                prefix.insert_prompt(ticket.block_hashes, prompt_blocks, len(held))
            if self.instance.config.dump_dir:
                ranks.call(Snapshot(rid, ServeRole.DECODE, blocks, slot, ticket.num_tokens))
            peer.client.release(rid, self.instance_id, ticket.block_ids, ticket.slot_id)
            released = True
            yield TokenEvent(
                rid,
                pulled.first_token,
                0,
                finished=request.max_tokens == 1,
                ttft_ms=(time.perf_counter() - start) * 1e3,
                transfer_ms=pulled.seconds * 1e3,
                kv_bytes=pulled.kv_bytes,
                state_bytes=pulled.state_bytes,
                descriptors=pulled.descriptors,
                logprob=pulled.first_logprob,
                cached_prompt_tokens=ticket.cached_tokens,
                reused_decode_tokens=reused,
                exposed_transfer_ms=pulled.exposed_s * 1e3,
            )
            first = DecodeStep(
                pulled.first_token, ticket.num_tokens, blocks, slot, request.sampling, 1
            )
            # Closed before the cache goes back, whatever ends the request: no later step
            # touches its slot or blocks.
            with contextlib.closing(self.batcher.stream(rid, first, request.max_tokens)) as picks:
                for index, pick in enumerate(picks, start=1):
                    yield TokenEvent(
                        rid,
                        pick.token,
                        index,
                        finished=index == request.max_tokens - 1,
                        logprob=pick.logprob,
                    )
        finally:
            if not released:
                self._abort(peer, ticket, f"decode {self.instance_id} dropped the request")
            self._return_cache(rid, slot)

    def _return_cache(self, rid: str, slot: int) -> None:
        """The only way a request's blocks and slot go back to the pools, whatever ended it
        (done, heartbeat or rank error, deadline, abort, client cancel, peer restart): ask
        every rank to end its transfer, and free only once none of its READs can still
        land; otherwise hold them until they settle (docs/bugs.md #14). A rank that cannot
        answer cannot vouch for its READs either, so that also holds."""
        try:
            settled = all(self.instance.ranks.call(TransferEnd(rid)))
        except PdxferError as exc:
            logger.warning("ending transfer of %r: %s", rid, exc)
            settled = False
        if settled:
            self._free(rid, slot)
        else:
            self._hold_until_settled(rid, slot)

    def _free(self, rid: str, slot: int) -> None:
        self.instance.staging.free(rid)
        try:
            self.instance.ranks.call(Release(slot))
        except PdxferError as exc:
            logger.warning("releasing slot %d of %r on the ranks: %s", slot, rid, exc)
        self.instance.pools.free(rid)
        self.instance.admission.freed()

    def _hold_until_settled(self, rid: str, slot: int) -> None:
        """Keep the blocks and slot of `rid` out of the pools until no READ can still land
        in them (docs/bugs.md, bug 6, from the transport's side)."""
        logger.warning("transfer of %r may still move bytes: holding its cache until settled", rid)
        with self._quarantine_lock:
            self._quarantine[rid] = slot
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="settle", daemon=True)
                self._reaper.start()

    def _reap(self) -> None:
        while not self._closed.wait(SETTLE_POLL_S):
            with self._quarantine_lock:
                held = dict(self._quarantine)
            for rid, slot in held.items():
                try:
                    settled = all(self.instance.ranks.call(TransferSettled(rid)))
                except PdxferError as exc:
                    logger.warning("polling the held transfer %r: %s", rid, exc)
                    continue
                if settled:
                    self._free(rid, slot)  # before it stops counting as held
                    with self._quarantine_lock:
                        del self._quarantine[rid]

    def held_requests(self) -> list[str]:
        """Requests whose cache is held until their failed READs settle."""
        with self._quarantine_lock:
            return sorted(self._quarantine)

    def _pull(
        self, peer: Peer, ticket: Ticket, blocks: tuple[int, ...], held: int, slot: int,
        reused: int, arrived: float,
    ) -> Pulled:  # fmt: skip
        """Read the ticket's cache (the KV after the first `held` of `blocks`, which this
        instance already holds, and the state) into `blocks` and `slot`. `arrived`: when
        the ticket came (time.perf_counter())."""
        request = transfer_request(ticket, blocks, slot)
        # Only the blocks being read are FILLING: the held ones are shared, read-only.
        new_blocks = blocks[held:]
        if ticket.stream_key:
            planner = StreamPlanner(
                peer.layouts, self.instance.layouts, request, ticket.stream_key,
                reused_tokens=reused, whole=self.instance.config.transfer_mode is TransferMode.WHOLE,
            )  # fmt: skip
            source = StreamSource(progress_entries(peer.layouts, ticket.slot_id))
            no_reads = tuple(RankReads(()) for _ in self.instance.layouts)
            seconds, exposed = self._transfer(
                peer, ticket, no_reads, new_blocks, slot, planner, source
            )
            token, logprob = planner.first_pick
            return Pulled(seconds, exposed, planner.kv_bytes, planner.state_bytes,
                          planner.descriptors, token, logprob)  # fmt: skip
        reads = plan_reads(
            peer.layouts,
            self.instance.layouts,
            request,
            request_id=ticket.request_id,
            holder=self.instance_id,
            stager=peer.client,
            pool=self.instance.staging,
            min_small_ranges=self.instance.config.staging_min_ranges,
            reused_tokens=reused,
        )
        seconds, _ = self._transfer(peer, ticket, reads.per_rank, new_blocks, slot)
        exposed = time.perf_counter() - arrived
        return Pulled(seconds, exposed, reads.kv_bytes, reads.state_bytes, reads.descriptors,
                      ticket.first_token, ticket.first_logprob)  # fmt: skip

    def _transfer(
        self,
        peer: Peer,
        ticket: Ticket,
        reads: tuple[RankReads, ...],
        blocks: tuple[int, ...],
        slot: int,
        planner: StreamPlanner | None = None,
        source: StreamSource | None = None,
    ) -> tuple[float, float]:
        """Post every rank's READs and poll them to DONE; (seconds taken, the slowest
        rank's from posting to done as the rank measured it; a stream's seconds from the
        poll that saw prefill finished to done, else the seconds taken). A stream
        (`planner` and `source`) posts more READs as the prefill ranks publish progress.
        Heartbeats keep the lease while waiting, and tell a stream early that its prefill
        failed; the transfer deadline bounds the heartbeats too. Raises TransferFailed or
        the heartbeat's ControlError; the caller's `_return_cache` decides whether the
        cache can go back."""
        ranks, rid = self.instance.ranks, ticket.request_id
        heartbeat_every = self.heartbeat_s or max(0.2, (ticket.lease_deadline - time.time()) / 3)
        if planner is not None:
            heartbeat_every = min(heartbeat_every, STREAM_HEARTBEAT_S)
        begin = last_beat = time.perf_counter()
        deadline = begin + self.transfer_deadline_s
        failure, seconds, finished_at = "not started", 0.0, None
        sealed = planner is None
        try:
            # a small whole transfer is often DONE in the start's answer already
            statuses = ranks.call(TransferStart(rid, peer.instance_id, reads, slot, blocks,
                                                self.transfer_deadline_s, source))  # fmt: skip
            if planner is not None:  # a stream's progress comes with its polls
                statuses = ranks.call(TransferPoll(rid))
            while True:
                polled_at = time.perf_counter()
                failed = [
                    f"rank {r}: {s.reason}"
                    for r, s in enumerate(statuses)
                    if s.state is TransferState.FAILED
                ]
                if failed:
                    failure = "; ".join(failed)
                    break
                if not sealed:
                    status = statuses[source.reader_rank]
                    more = planner.advance(status.progress)
                    if finished_at is None and (planner.finished or planner.complete):
                        finished_at = polled_at
                    if more is not None or planner.complete:
                        sealed = planner.complete
                        # `reads`: a stream starts with none, so it seals with none
                        ranks.call(TransferPost(rid, more or reads, sealed))
                elif all(s.state is TransferState.DONE for s in statuses):
                    failure, seconds = "", max(s.seconds for s in statuses)
                    break
                left = deadline - time.perf_counter()
                if left <= 0:
                    failure = f"not done within {self.transfer_deadline_s:g}s"
                    break
                if time.perf_counter() - last_beat > heartbeat_every:
                    peer.client.heartbeat(rid, self.instance_id, timeout_s=left)
                    last_beat = time.perf_counter()
                waiting = planner is not None and finished_at is None
                time.sleep(STREAM_POLL_S if waiting else POLL_INTERVAL_S)
                statuses = ranks.call(TransferPoll(rid))
        finally:
            seconds = seconds or time.perf_counter() - begin
            if failure and self.metrics is not None:
                self.metrics.record_transfer("failed", seconds, None, 0)
        if failure:
            self.forget(peer.address)
            try:
                settled = all(ranks.call(TransferEnd(rid)))
            except PdxferError:
                settled = False
            raise TransferFailed(
                f"transfer of {rid!r} from {peer.instance_id} failed: {failure}", settled=settled
            )
        if planner is None:
            return seconds, seconds
        return seconds, time.perf_counter() - finished_at

    def _abort(self, peer: Peer, ticket: Ticket, reason: str) -> None:
        try:
            peer.client.abort(ticket.request_id, ticket.abort_key, reason)
        except ControlError as exc:
            logger.info("abort of %r at %s: %s", ticket.request_id, peer.address, exc)

    def close(self) -> None:
        self._closed.set()
        self.batcher.close()
        with self._peer_lock:
            for peer in self._peers.values():
                peer.client.close()
            self._peers.clear()


def _unreachable(exc: BaseException) -> bool:
    """Whether `exc` says the prefill instance cannot be reached (handshake again)."""
    return isinstance(exc, PeerUnavailable) or getattr(exc, "code", "") == GrpcCode.UNAVAILABLE
