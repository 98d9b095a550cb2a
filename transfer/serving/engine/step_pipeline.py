"""The decode engine's steps at the ranks, and the threads that wait for their answers.

The engine loop is the only thread that sends rank commands (`send`): steps run in the
order it sends them, which the single-sender rule of the design needs, except that a step
that `overtakes` runs before the in-order steps still waiting at the ranks. Waiting for an
answer is a collector thread's job: one per lane (in order, overtaking), each blocking on
its lane's steps in turn, so the loop stays free to take new requests, plan and post
transfers while a decode step runs, and an overtaking step's answer is not held behind the
step it overtook. The loop then runs the answers' handlers itself (`handle_answered`): only
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
        self._on_answer = on_answer  # wakes the loop (called on a collector thread)
        self._timeout_s = timeout_s
        self._in_flight: deque[SentStep] = deque()  # the engine thread's own
        self._to_collect = {lane: queue.SimpleQueue() for lane in (False, True)}  # overtakes?
        self._answered: queue.SimpleQueue[tuple[SentStep, list[Answer]]] = queue.SimpleQueue()
        self.sender: threading.Thread | None = None  # the one thread that sends
        self._collectors = [
            threading.Thread(
                target=self._collect,
                args=(self._to_collect[lane],),
                name=f"{name}-collector{'-overtaking' if lane else ''}",
                daemon=True,
            )  # fmt: skip
            for lane in (False, True)
        ]
        for collector in self._collectors:
            collector.start()

    def __len__(self) -> int:
        """In-order steps sent whose answers the engine has not handled yet."""
        return sum(not sent.plan.overtakes for sent in self._in_flight)

    def answered_through(self, index: int) -> bool:
        """Whether every step up to `index` (by `StepPlan.index`) has been handled."""
        return all(sent.plan.index > index for sent in self._in_flight)

    def send(self, plan: StepPlan) -> bool:
        """Send `plan` as one EngineStep (the engine thread only). False when the rank group
        is gone: then every handler has had the error."""
        me = threading.current_thread()
        if self.sender is None:
            self.sender = me
        if me is not self.sender:
            raise RuntimeError(f"{me.name} sent a rank command: only {self.sender.name} may")
        try:
            pending = self._ranks.submit(EngineStep(tuple(plan.commands), plan.overtakes))
        except PdxferError as exc:  # the group is gone: every command failed
            for handler in plan.handlers:
                handler(exc)
            return False
        plan.sent_at = time.perf_counter()
        sent = SentStep(plan, pending)
        self._in_flight.append(sent)
        self._to_collect[plan.overtakes].put(sent)
        return True

    def handle_answered(self) -> int:
        """Run the handlers of every step answered so far, as answered; how many steps."""
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
        the collectors."""
        for lane in self._to_collect.values():
            lane.put(None)
        while self._in_flight:
            try:
                sent, answers = self._answered.get(timeout=self._timeout_s)
            except queue.Empty:
                break
            self._handle(sent, answers)
        for collector in self._collectors:
            collector.join(self._timeout_s)

    def _handle(self, sent: SentStep, answers: list[Answer]) -> None:
        if not sent.plan.overtakes:
            oldest = next(s for s in self._in_flight if not s.plan.overtakes)
            assert oldest is sent, "in-order steps are answered in the order they were sent"
        self._in_flight.remove(sent)
        sent.handle(answers)

    def _collect(self, lane: queue.SimpleQueue[SentStep | None]) -> None:
        while (sent := lane.get()) is not None:
            answers = sent.wait(self._timeout_s)  # a lane's steps are answered in order
            self._answered.put((sent, answers))
            self._on_answer()
