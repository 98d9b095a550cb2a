"""The decode instance's engine: one loop thread that alone commands the ranks.

Each step it takes the requests that arrived, handles what the prefill instances answered
(PeerClient events: handshakes, acquires, heartbeats, releases, aborts), admits requests
into the cache, and sends ONE rank command (`EngineStep`) carrying the step's frees, ends
of transfers, transfer starts, posts and polls, snapshots and the decode batch. When the
answer comes back it moves each request on: a finished transfer releases its ticket and
emits token 0, a decode batch's picks go to their requests (`decode_batches`), and an
ended request's cache goes back through the cache manager's `release` before its stream
ends (`decode_streams`).

Steps are pipelined (`PIPELINE_DEPTH`): the next step is sent before the current one's
answer is back, naming no token for the requests it continues (the rank feeds what it just
picked), so the ranks go from one step to the next without a round trip through here. The
ranks run the steps in the order they were sent. Collector threads wait for the answers
(`step_pipeline`), so the loop never blocks on a step: a new request's Acquire, plan and
TransferStart go on while a decode step runs.

A transfer's start and polls overtake (issue 33: the exposed transfer): they go at once, in
a step of their own that runs before the decode steps waiting at the ranks (with one rank,
beside the step running: `rank_inbox`), not behind them. That is safe when no step still
at the ranks touches the new request's blocks or slot, the only ones a start touches. They
came from the pools, where a request's blocks and slot go back when it is freed; every step
sent before that free, and the one carrying its Release, may still touch them. So a start
overtakes only once the step that carried the last Release of its slot or of one of its
blocks has been answered (`CacheManager.overtake_after`). Otherwise it goes in order, in a
step that holds the decode batch back (at most one step in a row), so its answer need not
wait for a decode step. A poll touches only its own request's transfer: it always
overtakes.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from transfer.control.client import ClientOptions
from transfer.control.metrics import WorkerMetrics
from transfer.control.peer_client import PeerClient, PeerEvent
from transfer.control.types import DecodeRequest
from transfer.errors import Cancelled, Closed, TransferFailed
from transfer.serving.engine.cache_manager import SETTLE_POLL_S, CacheManager
from transfer.serving.engine.decode_batches import DecodeBatches
from transfer.serving.engine.decode_setup import DecodeSetup
from transfer.serving.engine.decode_streams import DecodeStreams
from transfer.serving.engine.instance import Instance
from transfer.serving.engine.request import DecodePhase, Request
from transfer.serving.engine.step import Answer, StepPlan
from transfer.serving.engine.step_pipeline import StepPipeline
from transfer.serving.engine.transfer_progress import TransferProgress
from transfer.serving.engine.transfers import Outcome
from transfer.serving.ranks.commands import TransferPoll, TransferStart
from transfer.trace import TracePoint, mark

logger = logging.getLogger(__name__)

PIPELINE_DEPTH = 2  # steps at the ranks at once: one runs while the next waits there
IDLE_WAIT_S = 1.0  # an idle loop still wakes this often (held caches, admission waits)
STEP_TIMEOUT_S = 300.0


class DecodeEngine:
    """Runs every decode request of one instance on one thread."""

    def __init__(
        self,
        instance: Instance,
        instance_id: str,
        options: ClientOptions,
        metrics: WorkerMetrics | None = None,
        transfer_deadline_s: float = 60.0,
        known_prefill=(),
    ) -> None:
        self.instance = instance
        self.instance_id = instance_id
        self.metrics = metrics
        self.max_num_seqs = instance.config.max_seqs
        self.transfer_deadline_s = transfer_deadline_s
        self.heartbeat_s: float | None = None  # None: a third of the lease
        self.cache = CacheManager(instance)
        self._wake = threading.Event()
        self.peer_client = PeerClient(instance_id, options, max_workers=8, on_event=self._wake.set)
        self.setup = DecodeSetup(self, options, known_prefill)
        self.transfers = TransferProgress(self)
        self._new: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._planner_pool = ThreadPoolExecutor(2, thread_name_prefix="decode-plan")
        self.active: list[Request] = []  # every request not yet DONE and delivered
        self.streams = DecodeStreams(self)  # its requests' events, and their ends
        self._pending_commands: list[tuple] = []  # (command, handler) for the next step
        self._steps = StepPipeline(instance.ranks, self._wake.set, STEP_TIMEOUT_S, "decode")
        self.steps = 0  # steps sent: tests and metrics count in steps, not seconds
        self.decode_steps = 0  # of those, steps that carried a decode batch
        self.batches = DecodeBatches(self)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="decode-engine", daemon=True)
        self._thread.start()

    # -- called from other threads --------------------------------------------------------

    def submit(self, decode: DecodeRequest, sink=None, tag=None) -> Request:
        """Start `decode`; its events arrive on the returned request's `out`, or, with a
        `sink`, as `sink([(tag, item), ...])` once per step (`Request.sink`)."""
        request = Request(decode, sink=sink, sink_tag=tag)
        mark(TracePoint.DECODE_ARRIVED, request.request_id)
        if sink is not None:
            request.consumer_ready = True  # a sink takes every event as it comes
        if self._closed:
            raise Closed("decode engine: the instance is shutting down")
        self._new.put(request)
        self._wake.set()
        return request

    def cancel(self, request: Request) -> None:
        """The consumer went away: end the request (its cache goes back within a step or two)."""
        request.cancelled = True
        self._wake.set()

    def consumer_ready(self, request: Request) -> None:
        """The consumer asked for the tokens after token 0: the request may start decoding."""
        if not request.consumer_ready:
            request.consumer_ready = True
            self._wake.set()

    def call_soon(self, job: Callable[[], None]) -> None:
        """Run `job` on the engine thread at the start of its next step."""
        if self._closed:
            raise Closed("decode engine: the instance is shutting down")
        self._inbox.put(job)
        self._wake.set()

    def add_command(self, command, handler: Callable[[Answer], None] | None = None) -> None:
        """Engine thread only: send `command` in the next step."""
        self._pending_commands.append((command, handler))

    @property
    def held_back(self) -> int:
        """Steps that held the decode batch back for a transfer start."""
        return self.batches.held_back

    @property
    def num_running(self) -> int:
        return sum(1 for r in list(self.active) if r.phase is DecodePhase.RUNNING)

    def held_requests(self) -> list[str]:
        return sorted(list(self.cache.held))

    # -- the loop -------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._closed:
                if self._steps.handle_answered():
                    self.streams.deliver_finished()
                    self.streams.flush()  # the steps' events: one batch per sink
                self._intake()
                self.streams.flush()
                plan = self._overtaking_step()
                if plan is None and len(self._steps) < PIPELINE_DEPTH:
                    plan = self._build_step()
                if plan:
                    self._send(plan)
                    continue  # fill the pipeline
                self._wake.wait(self._idle_wait())  # an answer, a request, an event
                self._wake.clear()
        except Exception:  # noqa: BLE001 - a bug must not leave every stream hanging
            logger.exception("decode engine: the loop failed")
        finally:
            self._shut_down()

    def _intake(self) -> None:
        """Run the jobs and peer events queued, and start one new request: requests that
        arrive together then start one by one, each as soon as it is planned, with the
        answers that came in between handled first."""
        try:
            request = self._new.get_nowait()
        except queue.Empty:
            request = None
        if request is not None:
            self.active.append(request)
            self.setup.start(request)
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                break
            job()
        for event in self.peer_client.drain():
            self._on_peer_event(event)
        now = time.perf_counter()
        for request in list(self.active):
            self._advance(request, now)
        self.streams.deliver_finished()

    def _idle_wait(self) -> float:
        if not self._new.empty():
            return 0.0
        if len(self._steps) >= PIPELINE_DEPTH:  # nothing can be sent before an answer
            return IDLE_WAIT_S
        if any(_wants_poll_soon(r) for r in self.active):
            return 0.0005
        if self.cache.waiting or self.cache.busy or self._pending_commands:
            return 0.005
        if self.cache.held:
            return SETTLE_POLL_S / 5
        return IDLE_WAIT_S

    def _advance(self, request: Request, now: float) -> None:
        """Move `request` on as far as this step allows."""
        if request in self.streams.finishing:
            return
        if request.cancelled and not self.setup.busy(request):
            self.finish(request, Cancelled("decode: the caller went away"))
            return
        if request.phase is DecodePhase.ACQUIRED and request.slot < 0:
            self.setup.admit(request)
        elif request.phase is DecodePhase.TRANSFERRING and request.transfer is not None:
            self.transfers.advance(request, now)

    # -- building and sending a step ------------------------------------------------------

    def _overtaking_step(self) -> StepPlan | None:
        """The transfer polls due, and the starts no step at the ranks may interfere with,
        in a step that overtakes; None when there are none."""
        plan, rest = StepPlan(self.steps, overtakes=True), []
        for command, handler in self._pending_commands:
            if self._may_overtake(command):
                plan.add(command, handler)
            else:
                rest.append((command, handler))
        self._pending_commands = rest
        return plan or None

    def _may_overtake(self, command) -> bool:
        if isinstance(command, TransferPoll):
            return True
        if not isinstance(command, TransferStart):
            return False
        after = self.cache.overtake_after(command.slot, command.block_ids)
        return after is not None and self._steps.answered_through(after)

    def _build_step(self) -> StepPlan:
        plan = StepPlan(self.steps)
        frees, ending = self.cache.commands(plan.index)
        for command in frees:
            plan.add(command)
        for request in ending:
            plan.add(self.cache.end_command(request), lambda a, r=request: self._on_end(r, a))
        for request in self.cache.settle_polls():
            plan.add(self.cache.settle_command(request),
                     lambda a, r=request: self.cache.settled(r, _all_true(a)))  # fmt: skip
        pending, self._pending_commands = self._pending_commands, []
        for command, handler in pending:
            plan.add(command, handler)
        starts = any(isinstance(command, TransferStart) for command, _ in pending)
        self.batches.add(plan, starts)
        return plan

    def _send(self, plan: StepPlan) -> None:
        if self._steps.send(plan):
            self.steps += 1
            self.decode_steps += bool(plan.decode_batch)

    # -- answers --------------------------------------------------------------------------

    def is_ending(self, request: Request) -> bool:
        return request in self.streams.finishing or request not in self.active

    def is_finishing(self, request: Request) -> bool:
        """Ended: its stream ends once its cache is back."""
        return request in self.streams.finishing

    def plan_off_thread(self, job: Callable[[], object]):
        return self._planner_pool.submit(job)

    def call_soon_quietly(self, job: Callable[[], None]) -> None:
        """`call_soon`, dropping the job once the engine is closed."""
        with contextlib.suppress(Closed, RuntimeError):
            self.call_soon(job)

    def _on_end(self, request: Request, answer: Answer) -> None:
        if isinstance(answer, BaseException):
            logger.warning("ending transfer of %r: %s", request.request_id, answer)
        settled = _all_true(answer)
        failure = request.transfer_failure
        if failure and request.error is None:
            request.error = TransferFailed(failure, settled=settled)
        self.cache.ended(request, settled)

    # -- the end of a request -------------------------------------------------------------

    def emit(self, request: Request, item) -> None:
        """Hand `item` (a TokenEvent, END or an exception) to the request's consumer."""
        self.streams.emit(request, item)

    def finish(self, request: Request, error: BaseException | None) -> None:
        """End `request` (`DecodeStreams.finish`)."""
        self.streams.finish(request, error)

    def _on_peer_event(self, event: PeerEvent) -> None:
        self.setup.on_event(event)

    # -- shutting down --------------------------------------------------------------------

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(30)
        self._planner_pool.shutdown(wait=False, cancel_futures=True)
        self.peer_client.close(wait=False)
        self.setup.peers.close()

    def _shut_down(self) -> None:
        self._closed = True
        self._steps.drain()
        while True:
            try:
                self.active.append(self._new.get_nowait())
            except queue.Empty:
                break
        for request in self.active:
            self.emit(request, Closed("decode engine: the instance is shutting down"))
            request.released.set()
        self.active.clear()
        self.streams.flush()


def _wants_poll_soon(request: Request) -> bool:
    """A transfer whose next poll waits on the clock (not on an answer at the ranks)."""
    transfer = request.transfer
    waiting = transfer is None or transfer.polling or transfer.outcome is not Outcome.PENDING
    return request.phase is DecodePhase.TRANSFERRING and not waiting


def _all_true(answer: Answer) -> bool:
    return not isinstance(answer, BaseException) and all(answer)
