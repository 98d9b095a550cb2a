"""The decode engine's steps at the ranks, and the thread that waits for their answers.

The engine loop is the only thread that sends rank commands (`send`): commands run in the
order it sends them, which the single-sender rule of the design needs. Waiting for an
answer is another thread's job (the collector): it blocks on each step's answer in turn and
queues it, so the loop stays free to take new requests, plan and post transfers while a
decode step runs. The loop then runs the answer's handlers itself (`handle_answered`): only
the engine thread ever touches a request.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from transfer.errors import PdxferError
from transfer.serving.engine.step import Answer, EngineStep, SentStep, StepPlan


class StepPipeline:
    """Steps sent and not yet handled, in the order sent."""

    def __init__(self, ranks: Any, on_answer: Callable[[], None], timeout_s: float,
                 name: str = "engine") -> None:  # fmt: skip
        self._ranks = ranks
        self._on_answer = on_answer  # wakes the loop (called on the collector thread)
        self._timeout_s = timeout_s
        self._in_flight: deque[SentStep] = deque()  # the engine thread's own
        self._to_collect: queue.SimpleQueue[SentStep | None] = queue.SimpleQueue()
        self._answered: queue.SimpleQueue[tuple[SentStep, list[Answer]]] = queue.SimpleQueue()
        self.sender: threading.Thread | None = None  # the one thread that sends
        self._collector = threading.Thread(target=self._collect, name=f"{name}-collector",
                                           daemon=True)  # fmt: skip
        self._collector.start()

    def __len__(self) -> int:
        """Steps sent whose answers the engine has not handled yet."""
        return len(self._in_flight)

    def send(self, plan: StepPlan) -> bool:
        """Send `plan` as one EngineStep (the engine thread only). False when the rank group
        is gone: then every handler has had the error."""
        me = threading.current_thread()
        if self.sender is None:
            self.sender = me
        if me is not self.sender:
            raise RuntimeError(f"{me.name} sent a rank command: only {self.sender.name} may")
        try:
            pending = self._ranks.submit(EngineStep(tuple(plan.commands)))
        except PdxferError as exc:  # the group is gone: every command failed
            for handler in plan.handlers:
                handler(exc)
            return False
        plan.sent_at = time.perf_counter()
        sent = SentStep(plan, pending)
        self._in_flight.append(sent)
        self._to_collect.put(sent)
        return True

    def handle_answered(self) -> int:
        """Run the handlers of every step answered so far, in order; how many steps."""
        handled = 0
        while True:
            try:
                sent, answers = self._answered.get_nowait()
            except queue.Empty:
                return handled
            self._handle(sent, answers)
            handled += 1

    def drain(self) -> None:
        """Shutting down: handle every step in flight (waiting for its answer), then stop
        the collector."""
        self._to_collect.put(None)
        while self._in_flight:
            try:
                sent, answers = self._answered.get(timeout=self._timeout_s)
            except queue.Empty:
                break
            self._handle(sent, answers)
        self._collector.join(self._timeout_s)

    def _handle(self, sent: SentStep, answers: list[Answer]) -> None:
        oldest = self._in_flight.popleft()
        assert oldest is sent, "answers come back in the order the steps were sent"
        sent.handle(answers)

    def _collect(self) -> None:
        while (sent := self._to_collect.get()) is not None:
            answers = sent.wait(self._timeout_s)  # the ranks answer in the order sent
            self._answered.put((sent, answers))
            self._on_answer()
