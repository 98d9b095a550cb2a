"""How rank 0 takes its commands off its connection, and what runs beside its command loop.

Commands run in the order they arrive, except those that `overtake`: their sender vouches
that they touch nothing a command sent before them may still touch. So
- in a group of one rank, they run at once, on a thread of their own, beside whatever
  command the loop is running (`Lanes`): a transfer starts while a decode step computes;
- in a larger group, where every rank must run the commands in one order (the model's
  collectives), they run before the commands still waiting at rank 0 (`Inbox`).

Each answer goes back with its command's index, which the control side files it under.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from transfer.serving.ranks.rank_protocol import Stop

logger = logging.getLogger(__name__)


class Inbox:
    """Rank 0's commands for the loop, in arrival order but for those that overtake."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.received = 0
        self.waiting: deque[tuple[int, Any]] = deque()  # received, not run yet
        self.stopped = False  # a Stop came: read nothing more

    def next(self) -> tuple[int, Any]:
        """The next command to run and its index (Stop once the control process is gone)."""
        if not self.waiting:
            self._take(Stop() if self.stopped else _receive(self.conn))
        while not self.stopped and _ready(self.conn):  # what came while the last one ran
            self._take(_receive(self.conn))
        for i, (index, command) in enumerate(self.waiting):
            if getattr(command, "overtakes", False):
                del self.waiting[i]
                return index, command
        return self.waiting.popleft()

    def _take(self, command: Any) -> None:
        self.waiting.append((self.received, command))
        self.received += 1
        self.stopped = isinstance(command, Stop)


class Lanes:
    """Rank 0 of a group of one: a reader thread takes each command as it arrives; one that
    overtakes runs at once on the beside thread (`run` it, `answer` the indexed result),
    the others wait for the loop (`next`)."""

    def __init__(
        self,
        conn: Connection,
        run: Callable[[Any], Any],
        answer: Callable[[tuple[int, list[Any]]], None],
        bind_thread: Callable[[], None] | None = None,
    ) -> None:
        self.conn = conn
        self._run, self._answer, self._bind_thread = run, answer, bind_thread
        self._in_order: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._beside: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name="rank-reader", daemon=True)
        self._runner = threading.Thread(target=self._run_beside, name="rank-beside", daemon=True)
        self._reader.start()
        self._runner.start()

    def next(self) -> tuple[int, Any]:
        """The next in-order command and its index (Stop once the control process is gone)."""
        return self._in_order.get()

    def close(self, timeout_s: float) -> None:
        """Let the command running beside the loop finish, then stop that thread."""
        self._beside.put(None)
        self._runner.join(timeout_s)

    def _read(self) -> None:
        for index in itertools.count():
            try:
                command = _receive(self.conn)
            except Exception:  # noqa: BLE001 - e.g. a command that does not unpickle
                logger.exception("reading a command failed: stopping")
                command = Stop()
            overtakes = getattr(command, "overtakes", False)
            (self._beside if overtakes else self._in_order).put((index, command))
            if isinstance(command, Stop):
                return

    def _run_beside(self) -> None:
        if self._bind_thread is not None:
            self._bind_thread()
        while (item := self._beside.get()) is not None:
            index, command = item
            self._answer((index, [self._run(command)]))


def _receive(conn: Connection) -> Any:
    """The next command; Stop once the control process is gone."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return Stop()


def _ready(conn: Connection) -> bool:
    try:
        return conn.poll(0)
    except (EOFError, OSError):
        return True  # the next receive says Stop
