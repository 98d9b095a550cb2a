"""The Stage calls waiting for the prefill engine's next step, and the rule that keeps them
from waiting behind a prefill batch.

A Stage (decode asking the prefill ranks to pack a ticket's small ranges) is on the
decode's exposed path: the request's READs cannot start until it is answered. A prefill
batch holds the rank group for as long as it runs, so a Stage that arrives meanwhile is
refused at once (CapacityError: RESOURCE_EXHAUSTED), and decode reads the ranges directly;
one that arrives between steps goes out in a step of its own, ahead of the next batch.
Both sides of that rule take the same lock, so no Stage is queued after its step was
chosen to be a batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from transfer.errors import CapacityError
from transfer.serving.ranks.spec import Copies

B = TypeVar("B")


@dataclass(frozen=True)
class StageCall:
    """One Stage: gather `copies[r]` on rank r into a new extent of `nbytes` under
    `request_id`; `future` gets the extent's arena offset."""

    request_id: str
    copies: tuple[Copies, ...]
    nbytes: int
    future: Future


class StageQueue:
    """Stage calls for the next step (any thread offers; the engine loop takes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[StageCall] = []
        self._batch_running = False  # a step with a prefill batch is at the ranks
        self._closed: BaseException | None = None  # what every later Stage fails with

    def offer(self, request_id: str, copies: tuple[Copies, ...], nbytes: int) -> Future:
        """Queue a Stage for the next step; refused (the future fails with CapacityError)
        while a prefill batch runs."""
        future: Future = Future()
        with self._lock:
            refusal = self._closed
            if refusal is None and not self._batch_running:
                self._calls.append(StageCall(request_id, copies, nbytes, future))
                return future
        future.set_exception(refusal or CapacityError(
            f"request_id {request_id!r}: a prefill batch is running; read the ranges directly"
        ))  # fmt: skip
        return future

    def next_step(self, plan_batch: Callable[[], list[B]]) -> tuple[list[StageCall], list[B]]:
        """What the next step carries: the queued Stage calls alone, or else the prefill
        batch `plan_batch()` picks (from then on, until `batch_answered`, Stage is refused)."""
        with self._lock:
            calls, self._calls = self._calls, []
            batch = [] if calls else plan_batch()
            self._batch_running = bool(batch)
        return calls, batch

    def batch_answered(self) -> None:
        with self._lock:
            self._batch_running = False

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
            self._closed = error
        for call in calls:
            call.future.set_exception(error)
