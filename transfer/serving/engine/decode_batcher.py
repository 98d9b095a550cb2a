"""Continuous batching on a decode instance: one forward step for every running request.

Requests join once their transfer is DONE (their slot READY) and leave when they finish or
their consumer goes away, always between steps. Each step is one `DecodeBatch` rank
command; transfers of other requests are posted and polled between steps (the rank group
serialises commands), so a transfer never holds up the running batch, and the batch holds
a transfer up for at most the step that is running (a queued step yields to it).

Steps are pipelined (`PIPELINE_DEPTH`): the next step is sent before the current one's
picks come back, naming no token for the requests it continues (the rank feeds what it
just picked), so the ranks go from one step to the next without waiting for a round trip
through this process. A request that finishes by its length is never sent past it; one
whose consumer leaves is out within two steps.

Running requests are capped by `max_num_seqs`; admission already caps them by the number
of state slots, so the cap only bites below that.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from transfer.errors import Closed, InvalidInput, PdxferError, WrongState
from transfer.serving.ranks.commands import DecodeBatch, DecodeStep, TokenPick
from transfer.serving.ranks.rank_protocol import same_on_every_rank
from transfer.serving.ranks.ranks import Pending, RankGroup

logger = logging.getLogger(__name__)

_DONE = object()
PIPELINE_DEPTH = 2  # steps at the ranks at once: one runs while the next waits there


@dataclass(eq=False)  # compared by identity: `entry in running`
class _Running:
    request_id: str
    first: DecodeStep  # the request's first step on this instance
    last_index: int  # the stream index of the request's last token
    last_token: int  # the last token picked and delivered (the first step's, at first)
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: bool = False
    failed: bool = False
    scheduled: int = 0  # steps sent to the ranks
    delivered: int = 0  # of those, steps whose pick came back

    @property
    def wants_step(self) -> bool:
        alive = not (self.cancelled or self.failed)
        return alive and self.first.index + self.scheduled <= self.last_index

    @property
    def finished(self) -> bool:
        """Never to be stepped again, and no step of it at the ranks."""
        return self.scheduled == self.delivered and not self.wants_step

    def next_step(self) -> DecodeStep:
        """Its next step: with no token while its previous step's pick is still out."""
        k = self.scheduled
        token = self.last_token if k == self.delivered else None
        first = self.first
        return replace(first, token=token, position=first.position + k, index=first.index + k)


@dataclass
class _Sent:
    batch: list[_Running]
    pending: Pending
    sent_at: float


class DecodeBatcher:
    """Runs the decode steps of every joined request as batches on `ranks`."""

    def __init__(self, ranks: RankGroup, max_num_seqs: int, metrics=None) -> None:
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise InvalidInput(f"max_num_seqs: must be an int >= 1, got {max_num_seqs!r}")
        self.ranks = ranks
        self.max_num_seqs = max_num_seqs
        self.metrics = metrics
        self._waiting: list[_Running] = []  # joined, not yet in a step
        self._running: list[_Running] = []
        self._cond = threading.Condition()
        self._closed = False
        self._last_answer_at = 0.0
        self._thread = threading.Thread(target=self._loop, name="decode-batcher", daemon=True)
        self._thread.start()

    def stream(self, request_id: str, first: DecodeStep, max_tokens: int) -> Iterator[TokenPick]:
        """The picks of tokens `first.index` .. `max_tokens - 1`, one per step the request
        takes part in. Closing the iterator early takes the request out within two steps;
        once it has returned, no step touches the request's slot or blocks."""
        if first.index >= max_tokens:
            return
        if first.token is None:
            raise InvalidInput("token: a request's first decode step must name its token")
        entry = _Running(request_id, first, max_tokens - 1, first.token)
        with self._cond:
            if self._closed:
                raise Closed("decode batcher: the instance is shutting down")
            self._waiting.append(entry)
            self._cond.notify_all()
        try:
            while True:
                item = entry.out.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._leave(entry)

    @property
    def num_running(self) -> int:
        with self._cond:
            return len(self._running) + len(self._waiting)

    def _leave(self, entry: _Running) -> None:
        """Block until no step can touch `entry` any more."""
        with self._cond:
            entry.cancelled = True
            if entry in self._waiting:
                self._waiting.remove(entry)
            while entry in self._running:
                self._cond.wait()

    def _loop(self) -> None:
        sent: deque[_Sent] = deque()
        while True:
            with self._cond:
                while True:
                    self._running = [e for e in self._running if not e.finished]
                    self._cond.notify_all()  # leavers that are out
                    if self._closed or self._waiting or self._running or sent:
                        break
                    self._cond.wait()
                if self._closed:
                    for entry in self._waiting + self._running:
                        entry.out.put(Closed("decode batcher: the instance is shutting down"))
                    self._waiting.clear()
                    self._running.clear()
                    self._cond.notify_all()
                    return
                room = self.max_num_seqs - len(self._running)
                joining, self._waiting = self._waiting[:room], self._waiting[room:]
                self._running += [e for e in joining if not e.cancelled]
                batch = [e for e in self._running if e.wants_step]
            if batch and len(sent) < PIPELINE_DEPTH:
                self._send(batch, sent)
                if len(sent) < PIPELINE_DEPTH:
                    continue  # fill the pipeline before waiting on it
            if sent:
                self._answer(sent)

    def _send(self, batch: list[_Running], sent: deque[_Sent]) -> None:
        steps = tuple(e.next_step() for e in batch)
        try:
            pending = self.ranks.submit(DecodeBatch(steps))
        except PdxferError as exc:
            for entry in batch:
                self._fail(entry, exc)
            return
        for entry in batch:
            entry.scheduled += 1
        sent.append(_Sent(batch, pending, time.perf_counter()))

    def _answer(self, sent: deque[_Sent]) -> None:
        """Deliver the oldest step's picks; after a failure, settle every step sent."""
        oldest = sent.popleft()
        try:
            self._deliver(oldest)
            return
        except PdxferError as exc:
            failures = [(oldest.batch, exc)]
        except Exception as exc:  # noqa: BLE001 - a bug must not hang every stream
            logger.exception("decode batcher: step failed")
            failures = [(oldest.batch, exc)]
        # The steps sent after it continue its requests from picks it never made: they fail
        # their checks for those requests (and run for any others).
        while sent:
            later = sent.popleft()
            try:
                self._deliver(later)
            except Exception as exc:  # noqa: BLE001
                failures.append((later.batch, exc))
        retry: list[_Running] = []
        for k, (batch, exc) in enumerate(failures):
            checked = isinstance(exc, (InvalidInput, WrongState))
            # Only the oldest failure can be a lone request's own: a later step may have
            # failed its checks for want of a pick the failed step never made.
            theirs = k == 0 and len(batch) == 1
            for entry in batch:
                entry.scheduled -= 1  # its step ran nowhere, or it fails below
                if theirs or not checked:
                    self._fail(entry, exc)
                elif entry not in retry:
                    retry.append(entry)
        # A batch that failed its checks changed nothing: step each alone, with its token,
        # to find whose it is. Any other failure may have left states half-advanced, so
        # every request of that batch fails.
        if retry:
            logger.warning("decode batch of %d failed its checks; stepping each alone", len(retry))
        for entry in retry:
            if entry.wants_step:
                self._send([entry], sent)
                if sent:
                    self._answer(sent)

    def _deliver(self, item: _Sent) -> None:
        picks = same_on_every_rank(item.pending.result(), "decode step")
        now = time.perf_counter()
        if self.metrics is not None:  # the step ran from when it was sent or the last answer
            begin = max(item.sent_at, self._last_answer_at)
            self.metrics.record_decode_step(len(item.batch), now - begin)
        self._last_answer_at = now
        for entry, pick in zip(item.batch, picks, strict=True):
            entry.delivered += 1
            entry.last_token = pick.token
            entry.out.put(pick)
            if entry.first.index + entry.delivered > entry.last_index:
                entry.out.put(_DONE)

    def _fail(self, entry: _Running, exc: BaseException) -> None:
        entry.out.put(exc)
        entry.failed = True  # leaves once no step of it is at the ranks

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(30)
