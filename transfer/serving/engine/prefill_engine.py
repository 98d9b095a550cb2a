"""The prefill instance's engine: one loop thread that alone commands the ranks.

Each step it takes the prompts that arrived and the events other threads queued (frees
from the ticket store, Stage calls, settle barriers), admits waiting prompts into the
cache, and sends ONE rank command (`EngineStep`) carrying the step's slot releases and
either the stage gathers (never behind a batch: `prefill_stages`) or the prefill batch
(`prefill_plan`) with its dump snapshots. When the answer comes back
it moves each prompt on: a prompt whose last chunk ran goes into the prefix cache and
publishes its ticket (its handler returns it); a freed ticket's cache goes back through
the cache manager's `release` (`prefill_answers`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from transfer.cache.extents import count_runs
from transfer.control.metrics import WorkerMetrics
from transfer.control.types import FreeReason, PrefillRequest, Ticket
from transfer.errors import (
    Cancelled,
    Closed,
    DeadlineExceeded,
    PdxferError,
)
from transfer.serving.engine.cache_manager import PROMPT_WAIT_S, CacheManager
from transfer.serving.engine.instance import Instance
from transfer.serving.engine.prefill_answers import PrefillAnswers
from transfer.serving.engine.prefill_plan import check_budget, chunk_of, plan_batch
from transfer.serving.engine.prefill_stages import StageQueue
from transfer.serving.engine.prefill_tickets import PrefillTickets
from transfer.serving.engine.request import PrefillPhase, Prompt
from transfer.serving.engine.step import EngineStep, SentStep, StepPlan
from transfer.serving.ranks.commands import PrefillBatch, Snapshot
from transfer.serving.ranks.progress import TransferMode
from transfer.serving.ranks.spec import Copies
from transfer.serving.role import ServeRole

logger = logging.getLogger(__name__)

FREE_WAIT_S = 30.0  # how long a prompt waits for the free of an earlier one of its id
IDLE_WAIT_S = 1.0  # an idle loop still wakes this often (admission deadlines)
WAITING_POLL_S = 0.05  # how often prompts waiting on an earlier one of their id look again
STEP_TIMEOUT_S = 300.0


class PrefillEngine:
    """Runs every prompt of one prefill instance on one thread; `store` holds its tickets."""

    def __init__(
        self,
        instance: Instance,
        instance_id: str,
        address: str,
        lease_s: float,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.instance = instance
        self.metrics = metrics
        self.budget = check_budget(instance.config.max_num_batched_tokens)
        self.tickets = PrefillTickets(
            instance, instance_id, address, lease_s, self._on_free, metrics
        )
        self.answers = PrefillAnswers(self)
        self.store = self.tickets.store
        self.cache = CacheManager(instance, wait_s=PROMPT_WAIT_S)
        self.layerwise = instance.config.transfer_mode is TransferMode.LAYERWISE
        self.queued: list[Prompt] = []  # QUEUED, in arrival order
        self.running: list[Prompt] = []  # ALLOCATED or PREFILLING, in arrival order
        self.holding: dict[str, Prompt] = {}  # request id -> the prompt holding a cache under it
        self._stages = StageQueue()
        self._new: queue.SimpleQueue[Prompt] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._barriers: list[threading.Event] = []
        self._wake = threading.Event()
        self.steps = 0  # steps sent: tests count in steps, not seconds
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="prefill-engine", daemon=True)
        self._thread.start()

    # -- called from other threads --------------------------------------------------------

    def submit(
        self, request: PrefillRequest, is_cancelled: Callable[[], bool] | None = None
    ) -> Prompt:
        """Queue `request`; its Ticket (or the error that ended it) arrives on `out`. Once
        `is_cancelled()` is true the prompt stops at its next chunk and frees its cache."""
        prompt = Prompt(request) if is_cancelled is None else Prompt(request, is_cancelled)
        if self._closed:
            raise Closed("prefill engine: the instance is shutting down")
        self._new.put(prompt)
        self._wake.set()
        return prompt

    def call_soon(self, job: Callable[[], None]) -> None:
        """Run `job` on the engine thread before its next step."""
        if self._closed:
            raise Closed("prefill engine: the instance is shutting down")
        self._events.put(job)
        self._wake.set()

    def stage(self, request_id: str, copies: tuple[Copies, ...], nbytes: int) -> Future:
        """Gather a held ticket's ranges (`copies[r]` on rank r, already placed at offsets
        from 0) into one staging extent; the future's result is the extent's arena offset."""
        if self._closed:
            raise Closed("prefill engine: the instance is shutting down")
        future = self._stages.offer(request_id, copies, nbytes)
        self._wake.set()
        return future

    def settle(self, timeout_s: float) -> bool:
        """Whether the cache of every request freed so far is back (pools and ranks)."""
        barrier = threading.Event()
        try:
            self.call_soon(lambda: self._barriers.append(barrier))
        except Closed:
            return True
        return barrier.wait(timeout_s)

    def _on_free(self, ticket: Ticket, reason: FreeReason) -> None:
        """The ticket store's callback (any thread): the loop frees the cache."""
        if reason is not FreeReason.RELEASED:
            logger.info("request %r freed: %s", ticket.request_id, reason.value)
        with contextlib.suppress(Closed):
            self.call_soon(lambda: self.answers.ticket_freed(ticket))

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.queued)

    # -- the loop -------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._closed:
                self._intake()
                plan = self._build_step()
                barriers, self._barriers = self._barriers, []
                if plan:
                    self._run(plan)
                    self._stages.batch_answered()
                for barrier in barriers:  # the frees queued before it are sent and answered
                    barrier.set()
                if not plan:
                    self._wake.wait(self._idle_wait())
                    self._wake.clear()
        except Exception:  # noqa: BLE001 - a bug must not leave every caller hanging
            logger.exception("prefill engine: the loop failed")
        finally:
            self._shut_down()

    def _idle_wait(self) -> float:
        if self.cache.waiting:  # a deadline to check
            return min(IDLE_WAIT_S, WAITING_POLL_S * 4)
        if self.queued:  # waiting on an earlier prompt of their id
            return WAITING_POLL_S
        return IDLE_WAIT_S

    def _intake(self) -> None:
        while True:
            try:
                job = self._events.get_nowait()
            except queue.Empty:
                break
            job()
        while True:
            try:
                self.queued.append(self._new.get_nowait())
            except queue.Empty:
                break
        for prompt in [*self.queued, *self.running]:
            if prompt.cancelled:
                self.fail(prompt, Cancelled(f"request {prompt.request_id!r}: cancelled"))
        for prompt in list(self.queued):
            self._admit(prompt)

    def _admit(self, prompt: Prompt) -> None:
        rid = prompt.request_id
        try:
            if rid in self.holding:  # a retry under its id, before the last attempt's free
                if time.monotonic() - prompt.arrived > FREE_WAIT_S:
                    raise DeadlineExceeded(
                        f"request_id {rid!r}: its last attempt's cache was not freed within "
                        f"{FREE_WAIT_S:g} s"
                    )
                return
            unchanged = prompt.frees_seen == self.cache.frees  # nothing freed since its last try
            waited = time.monotonic() - prompt.waited_since
            if prompt in self.cache.waiting and unchanged and waited <= self.cache.wait_s:
                return
            if not self.cache.admit_prompt(prompt):
                return
        except PdxferError as exc:
            self.fail(prompt, exc)
            return
        self.queued.remove(prompt)
        self.holding[rid] = prompt
        prompt.phase = PrefillPhase.ALLOCATED
        self.running.append(prompt)
        if self.metrics is not None:
            self.metrics.record_block_runs(count_runs(prompt.blocks))
        if self.layerwise:
            self.answers.publish_early(prompt)

    def _build_step(self) -> StepPlan:
        plan = StepPlan(self.steps)
        releases, _ = self.cache.commands()  # a prompt's cache never has a transfer to end
        for command in releases:
            plan.add(command)
        stages, batch = self._stages.next_step(lambda: plan_batch(self.running, self.budget))
        for call in stages:
            rid = call.request_id
            gather = self.tickets.stage(self.holding.get(rid), rid, call.copies, call.nbytes,
                                        call.future)  # fmt: skip
            if gather is not None:
                plan.add(*gather)
        if stages and not plan:  # every Stage answered already: the batch goes next, now
            self._wake.set()
        if batch:
            saves = [self._reserve(p, n) for p, n in batch]
            chunks = tuple(
                chunk_of(p, n, -1 if save is None else save[1])
                for (p, n), save in zip(batch, saves, strict=True)
            )
            for prompt, _ in batch:
                prompt.phase = PrefillPhase.PREFILLING
            plan.add(PrefillBatch(chunks), lambda a: self.answers.on_picks(batch, saves, a))
            if self.instance.config.dump_dir:  # in the same step: before any free can come
                for prompt, n in batch:
                    if prompt.done + n == prompt.num_tokens:
                        snapshot = Snapshot(prompt.request_id, ServeRole.PREFILL, prompt.blocks,
                                            prompt.slot, prompt.num_tokens)  # fmt: skip
                        plan.add(snapshot, lambda a, p=prompt: self.answers.on_snapshot(p, a))
        return plan

    def _run(self, plan: StepPlan) -> None:
        """Send the step and handle its answer (one step at a time: the next step's plan
        needs this one's picks)."""
        try:
            pending = self.instance.ranks.submit(EngineStep(tuple(plan.commands)))
        except PdxferError as exc:  # the group is gone: every command failed
            for handler in plan.handlers:
                handler(exc)
            return
        self.steps += 1
        SentStep(plan, pending).answer(STEP_TIMEOUT_S)

    def _reserve(self, prompt: Prompt, n: int) -> tuple[bytes, int] | None:
        """(unit hash, checkpoint slot) when this chunk ends at a checkpoint position and
        the prefix cache has a slot for it."""
        block_hash = prompt.stops.get(prompt.done + n)
        if block_hash is None:
            return None
        slot = self.instance.prefix.reserve_checkpoint(block_hash)
        return None if slot is None else (block_hash, slot)

    # -- the end of a prompt ------------------------------------------------------------

    def fail(self, prompt: Prompt, error: BaseException) -> None:
        """End `prompt` with `error` (`PrefillAnswers.fail`)."""
        self.answers.fail(prompt, error)

    # -- shutting down --------------------------------------------------------------------

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(30)

    def _shut_down(self) -> None:
        self._closed = True
        while True:
            try:
                self.queued.append(self._new.get_nowait())
            except queue.Empty:
                break
        closed = Closed("prefill engine: the instance is shutting down")
        for prompt in [*self.queued, *self.running]:
            if prompt.ticket is None:
                prompt.out.put(closed)
        self.queued.clear()
        self.running.clear()
        self._stages.fail_all(closed)
        for barrier in self._barriers:
            barrier.set()
