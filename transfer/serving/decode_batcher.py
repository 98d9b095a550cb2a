"""Continuous batching on a decode instance: one forward step for every running request.

Requests join once their transfer is DONE (their slot READY) and leave when they finish or
their consumer goes away, always between steps. Each step is one `DecodeBatch` rank
command; transfers of other requests are posted and polled between steps (the rank group
serialises commands), so a transfer never holds up the running batch, and the batch holds
a transfer up for at most one step.

Running requests are capped by `max_num_seqs`; admission already caps them by the number
of state slots, so the cap only bites below that.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from transfer.errors import Closed, InvalidInput, PdxferError, WrongState
from transfer.serving.commands import DecodeBatch, DecodeStep, TokenPick
from transfer.serving.rank_protocol import same_on_every_rank
from transfer.serving.ranks import RankGroup

logger = logging.getLogger(__name__)

_DONE = object()


@dataclass(eq=False)  # compared by identity: `entry in running`
class _Running:
    request_id: str
    step: DecodeStep  # the next one to run
    last_index: int  # the stream index of the request's last token
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: bool = False


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
        self._thread = threading.Thread(target=self._loop, name="decode-batcher", daemon=True)
        self._thread.start()

    def stream(self, request_id: str, first: DecodeStep, max_tokens: int) -> Iterator[TokenPick]:
        """The picks of tokens `first.index` .. `max_tokens - 1`, one per step the request
        takes part in. Closing the iterator early takes the request out before the next
        step; once it has returned, no step touches the request's slot or blocks."""
        if first.index >= max_tokens:
            return
        entry = _Running(request_id, first, max_tokens - 1)
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
        while True:
            with self._cond:
                while not self._closed and not (self._waiting or self._running):
                    self._cond.wait()
                if self._closed:
                    for entry in self._waiting + self._running:
                        entry.out.put(Closed("decode batcher: the instance is shutting down"))
                    self._waiting.clear()
                    self._running.clear()
                    self._cond.notify_all()
                    return
                self._running = [e for e in self._running if not e.cancelled]
                room = self.max_num_seqs - len(self._running)
                joining, self._waiting = self._waiting[:room], self._waiting[room:]
                self._running += [e for e in joining if not e.cancelled]
                batch = list(self._running)
                self._cond.notify_all()  # leavers that were cancelled are out
            try:
                self._step(batch)
            except Exception as exc:  # noqa: BLE001 - a bug must not hang every stream
                logger.exception("decode batcher: step failed")
                for entry in batch:
                    self._fail(entry, exc)
            with self._cond:
                finished = [e for e in batch if e.cancelled or e.step.index > e.last_index]
                self._running = [e for e in self._running if e not in finished]
                self._cond.notify_all()

    def _step(self, batch: list[_Running]) -> None:
        if not batch:
            return
        begin = time.perf_counter()
        try:
            results = self.ranks.call(DecodeBatch(tuple(e.step for e in batch)))
            picks = same_on_every_rank(results, "decode step")
        except PdxferError as exc:
            # A batch that failed its checks (bad input, a slot still FILLING) changed
            # nothing: step each alone to find whose it is. Any other failure may have left
            # states half-advanced, so every request of the batch fails.
            if len(batch) == 1 or not isinstance(exc, (InvalidInput, WrongState)):
                for entry in batch:
                    self._fail(entry, exc)
                return
            logger.warning("decode batch of %d failed (%s); stepping each alone", len(batch), exc)
            for entry in batch:
                self._step([entry])
            return
        if self.metrics is not None:
            self.metrics.record_decode_step(len(batch), time.perf_counter() - begin)
        for entry, pick in zip(batch, picks, strict=True):
            step = entry.step
            entry.out.put(pick)
            entry.step = replace(
                step, token=pick.token, position=step.position + 1, index=step.index + 1
            )
            if entry.step.index > entry.last_index:
                entry.out.put(_DONE)

    def _fail(self, entry: _Running, exc: BaseException) -> None:
        entry.out.put(exc)
        entry.step = replace(entry.step, index=entry.last_index + 1)  # leaves after this step

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(30)
