"""Prefill instance: run a prompt on all ranks, publish a ticket, free the cache when told.

The ticket store calls `_on_free` exactly once per ticket (Release, Abort or lease expiry);
that is the only place a published request's blocks and slot go back to the pools.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from transfer.cache.extents import count_runs
from transfer.cache.prefix_cache import PrefixHit, block_hashes
from transfer.control.errors import ControlError, UnknownRequest
from transfer.control.metrics import WorkerMetrics
from transfer.control.tickets import TicketStore
from transfer.control.types import (
    ControlConfig,
    FreeReason,
    HandshakeReply,
    PrefillRequest,
    SamplingParams,
    StageRequest,
    Ticket,
    compat_hash,
)
from transfer.errors import CapacityError, DeadlineExceeded, InvalidInput, PdxferError
from transfer.serving.engine.checkpoints import PREFIX_UNIT, checkpoint_positions, checkpoint_stops
from transfer.serving.engine.frees import FreeQueue
from transfer.serving.engine.instance import Instance
from transfer.serving.engine.prefill_batcher import PrefillBatcher
from transfer.serving.ranks.commands import Release, Snapshot, StageGather, TokenPick
from transfer.serving.ranks.progress import TransferMode, next_key
from transfer.serving.ranks.rank_protocol import RankCommandError, RankGroupDead
from transfer.serving.ranks.spec import Copies
from transfer.serving.role import ServeRole

logger = logging.getLogger(__name__)

NO_HIT = PrefixHit((), None, 0)
JOB_WAIT_LOG_S = 30.0  # a freed stream whose prefill has not stopped yet is logged this often
FREE_WAIT_S = 30.0  # how long a request waits for the free of an earlier one of its id


@dataclass(eq=False)
class _Allocated:
    """A prompt with its cache allocated, to prefill now or in the background."""

    request_id: str
    prompt_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    slot: int
    sampling: SamplingParams
    hit: PrefixHit
    hashes: tuple[bytes, ...]  # one per full block: the ticket's, for decode and the router
    unit_hashes: tuple[bytes, ...]  # one per full PREFIX_UNIT: this instance's prefix cache
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


class PrefillWorker:
    """Serves `Prefill` and (through `store`) the TransferService of one instance."""

    def __init__(
        self,
        instance: Instance,
        instance_id: str,
        address: str,
        lease_s: float,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.instance = instance
        self.instance_id = instance_id
        self.metrics = metrics
        plan = instance.plan
        config = ControlConfig(
            num_kv_blocks=plan.num_kv_blocks,
            num_state_slots=plan.num_state_slots,
            block_size=plan.block_size,
            max_blocks_per_request=plan.num_kv_blocks,
            lease_s=lease_s,
        )
        self.store = TicketStore(
            config, self._on_free, instance_id=instance_id, address=address, metrics=metrics
        )
        self.identity = HandshakeReply(
            instance_id=instance_id,
            compat=instance.compat,
            compat_hash=compat_hash(instance.compat),
            rank_metadata=instance.rank_metadata,
            rank_layouts=instance.rank_layouts,
        )

        self._jobs: dict[str, _Allocated] = {}  # streamed prompts still prefilling
        self._keys: dict[int, int] = {}  # slot -> the stream key it last had
        self._jobs_lock = threading.Lock()
        self._frees = FreeQueue("prefill-frees")
        self.batcher = PrefillBatcher(
            instance.ranks, instance.config.max_num_batched_tokens, instance.prefix
        )
        if metrics is not None:
            metrics.track_requests(
                running=lambda: self.batcher.num_running,
                waiting=lambda: instance.admission.waiting,
            )
            staging = instance.staging
            metrics.track_staging(free=lambda: staging.free_bytes, total=staging.capacity_bytes)

    def start(self) -> PrefillWorker:
        self.store.start()
        return self

    def prefill(
        self, request: PrefillRequest, is_cancelled: Callable[[], bool] = lambda: False
    ) -> Ticket:
        """Run the prompt; the ticket names the blocks and slot that hold its cache. Once
        `is_cancelled()` is true the prompt stops at its next chunk and frees its cache.
        With `--transfer-mode layerwise` the ticket comes back as soon as the cache is
        allocated, and the prompt runs in the background (`_publish_early`)."""
        vocab = self.instance.config.geometry.vocab_size
        bad = [t for t in request.prompt_ids if t >= vocab]
        if bad:
            raise InvalidInput(f"prompt_ids: token ids must be < vocab size {vocab}, got {bad[:5]}")
        num_tokens = len(request.prompt_ids)
        rid, prompt = request.request_id, tuple(request.prompt_ids)
        # A retry under the same id (the router's, after a failed decode) finds the last
        # attempt's cache still allocated under it until that free has run.
        if not self._frees.wait_for(rid, FREE_WAIT_S):
            raise DeadlineExceeded(
                f"request_id {rid!r}: its last attempt's cache was not freed within {FREE_WAIT_S:g} s"
            )
        prefix, hit, block_size = self.instance.prefix, NO_HIT, self.instance.block_size
        hashes = block_hashes(prompt, block_size)  # for decode's cache too
        units = hashes
        if prefix is not None:
            units = hashes if block_size == PREFIX_UNIT else block_hashes(prompt, PREFIX_UNIT)
            hit = prefix.match(units, num_tokens - 1, rid)
        try:
            cache = self.instance.admission.allocate(rid, num_tokens, prefix_blocks=hit.block_ids)
        except BaseException:
            self._drop_hit(rid, hit)
            raise
        if self.metrics is not None:
            self.metrics.record_block_runs(count_runs(cache.block_ids))
        blocks, slot = tuple(cache.block_ids), cache.slot_ids[0]
        job = _Allocated(rid, prompt, blocks, slot, request.sampling, hit, hashes, units)
        if self.instance.config.transfer_mode is TransferMode.LAYERWISE:
            return self._publish_early(job)
        try:
            first = self._run(job, is_cancelled)
            return self.store.publish(
                rid, list(blocks), slot, num_tokens, first.token, first_logprob=first.logprob,
                cached_tokens=hit.num_tokens, block_hashes=hashes,
            )  # fmt: skip
        except BaseException:
            self._free(rid, slot)
            raise

    def _run(
        self, job: _Allocated, is_cancelled: Callable[[], bool], stream_key: int = 0
    ) -> TokenPick:
        """Prefill `job` into its cache (publishing progress under `stream_key`); the first
        token. The prefix cache takes the prompt's blocks; --dump-dir gets its caches."""
        prefix, hit, num_tokens = self.instance.prefix, job.hit, len(job.prompt_ids)
        try:
            stops = {}
            if prefix is not None:
                interval = self.instance.config.checkpoint_interval
                positions = checkpoint_positions(num_tokens, hit.num_tokens, interval)
                stops = checkpoint_stops(job.unit_hashes, positions)
            first = self.batcher.run(
                job.request_id, job.prompt_ids, job.block_ids, job.slot, job.sampling,
                is_cancelled, cached_tokens=hit.num_tokens,
                restore_from=-1 if hit.checkpoint_slot is None else hit.checkpoint_slot,
                checkpoints=stops, stream_key=stream_key,
                copy_block=-1 if hit.copy_from is None else hit.copy_from,
            )  # fmt: skip
            if prefix is not None:
                prefix.insert_prompt(job.unit_hashes, job.block_ids, hit.num_tokens // prefix.unit)
            if self.instance.config.dump_dir:
                self.instance.ranks.call(
                    Snapshot(job.request_id, ServeRole.PREFILL, job.block_ids, job.slot, num_tokens)
                )
            return first
        finally:
            self._let_go(hit)
            if self.metrics is not None and prefix is not None:
                self.metrics.record_prefix(prefix.counts())

    def _publish_early(self, job: _Allocated) -> Ticket:
        """Layer-wise streaming: publish the ticket now, with a fresh key for the slot, and
        prefill in the background; decode reads each part once the ranks publish it. A
        failed prefill aborts the ticket, so its decode's next heartbeat fails."""
        with self._jobs_lock:
            key = next_key(self._keys.get(job.slot, 0))
            self._keys[job.slot] = key
            # before the ticket exists: an Abort right after publishing must find the job
            self._jobs[job.request_id] = job
        try:
            ticket = self.store.publish(
                job.request_id, list(job.block_ids), job.slot, len(job.prompt_ids), 0,
                cached_tokens=job.hit.num_tokens, block_hashes=job.hashes, stream_key=key,
            )  # fmt: skip
        except BaseException:
            with self._jobs_lock:
                self._jobs.pop(job.request_id, None)
            self._free(job.request_id, job.slot)
            self._let_go(job.hit)
            raise
        thread = threading.Thread(
            target=self._run_streamed, args=(job, key), name="prefill-stream", daemon=True
        )
        thread.start()
        return ticket

    def _run_streamed(self, job: _Allocated, key: int) -> None:
        failure: BaseException | None = None
        try:
            self._run(job, job.cancelled.is_set, stream_key=key)
        except BaseException as exc:  # noqa: BLE001 - reported through the ticket
            failure = exc
        finally:
            job.done.set()
        if failure is not None and not job.cancelled.is_set():
            logger.warning("streamed prefill of %r failed: %s", job.request_id, failure)
            with contextlib.suppress(ControlError, PdxferError):
                self.store.abort(job.request_id, f"prefill failed: {failure}")

    def _drop_hit(self, rid: str, hit: PrefixHit) -> None:
        """Give back what a prefix hit took when the request could not be allocated."""
        if hit.block_ids:
            self.instance.pools.blocks.free_request(rid)
        self._let_go(hit)

    def _let_go(self, hit: PrefixHit) -> None:
        """The hit's state and partial block were copied (or never will be): unpin its
        checkpoint and drop the reference on the block it copied from."""
        if hit.checkpoint_slot is not None:
            self.instance.prefix.unpin(hit.checkpoint_slot)
        if hit.copy_from is not None:
            self.instance.prefix.release_copy_source(hit.copy_from)

    def stage(self, request: StageRequest) -> int:
        """Pack a held ticket's ranges (`request.ranks[r]` on rank r) back to back into one
        staging extent; returns its arena offset, the same on every rank. The extent goes
        back with the ticket. CapacityError when no extent is free: the caller reads the
        ranges directly."""
        layouts, staging = self.instance.layouts, self.instance.staging
        if len(request.ranks) != len(layouts):
            raise InvalidInput(
                f"ranks: {len(request.ranks)} given, this instance has tp {len(layouts)}"
            )
        nbytes, rid = request.nbytes, request.request_id
        if nbytes == 0:
            raise InvalidInput("ranks: no range to stage")
        offset = staging.allocate(rid, nbytes)
        if offset is None:
            raise CapacityError(
                f"staging: {nbytes} bytes asked, the largest free extent is "
                f"{staging.largest_free_bytes} of {staging.capacity_bytes}"
            )
        base = layouts[0].staging_offset + offset
        try:
            copies = tuple(_packed(g.src_offsets, g.lengths, base) for g in request.ranks)
            self.instance.ranks.call(StageGather(copies))
            if self.store.get(rid) is None:  # freed meanwhile: `_on_free` found no extent
                raise UnknownRequest(f"request_id {rid!r}: freed while staging")
        except BaseException:
            staging.free(rid)
            raise
        if self.metrics is not None:
            self.metrics.transfers_staged.inc()
        return base

    def _on_free(self, ticket: Ticket, reason: FreeReason) -> None:
        if reason is not FreeReason.RELEASED:
            logger.info("request %r freed: %s", ticket.request_id, reason.value)
        with self._jobs_lock:
            job = self._jobs.pop(ticket.request_id, None)
        if job is not None:  # a stream still prefilling stops at its next chunk
            job.cancelled.set()
        # The ticket is gone, so no caller can read its cache any more; the blocks and slot
        # go back once the ranks have released the slot, off the caller's thread.
        self._frees.put(lambda: self._free_published(ticket, job), key=ticket.request_id)

    def _free_published(self, ticket: Ticket, job: _Allocated | None) -> None:
        if job is not None:
            while not job.done.wait(JOB_WAIT_LOG_S):
                logger.warning("request %r: waiting for its prefill to stop", ticket.request_id)
        self._free(ticket.request_id, ticket.slot_id)

    def settle(self, timeout_s: float = 30.0) -> bool:
        """Whether the cache of every request freed so far is back in the pools, waiting up
        to `timeout_s`."""
        return self._frees.wait_idle(timeout_s)

    def _free(self, request_id: str, slot: int) -> None:
        self.instance.staging.free(request_id)
        try:
            self.instance.ranks.call(Release(slot))
        except (RankCommandError, RankGroupDead) as exc:
            logger.warning("releasing slot %d of %r on the ranks: %s", slot, request_id, exc)
        self.instance.pools.free(request_id)
        self.instance.admission.freed()

    def close(self) -> None:
        self.batcher.close()
        self.store.stop()
        self._frees.close()


def _packed(src_offsets: tuple[int, ...], lengths: tuple[int, ...], start: int) -> Copies:
    src = np.array(src_offsets, dtype=np.int64)
    nbytes = np.array(lengths, dtype=np.int64)
    dst = start + np.concatenate(([0], np.cumsum(nbytes)[:-1])).astype(np.int64)
    return Copies(src, dst[: len(nbytes)], nbytes)
