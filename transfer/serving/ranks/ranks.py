"""Rank processes of one group, and the control process's handle on them.

The control process talks to rank 0 over a connection (`RankLink`); rank 0 broadcasts every
command to the group, every rank runs it on its own shard, and rank 0 sends back the
per-rank results (see `transfer.serving.ranks.rank_process`). Commands run one at a time, in the
same order on every rank, which is what the model's collectives require.

A rank that raises answers a failure for that command and keeps serving; a rank process
that dies takes the group down (its peers fail in the next collective), and every later
call raises `RankGroupDead`. The same processes serve the workers (`pdxfer serve`) and the
transfer benchmark, locally, inside a network namespace (`wrap`), or on another node (the
benchmark's rank host hands rank 0 an authenticated socket).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Generic, TypeVar

from transfer.net import free_port
from transfer.serving.ranks.rank_protocol import (
    HEARTBEAT_S,
    RankCommand,
    RankFailure,
    RankGroupDead,
    RankLaunch,
    Stop,
    command_error,
)

R = TypeVar("R")
ROOT = str(Path(__file__).resolve().parents[3])  # the checkout (this is transfer/serving/ranks/)
RANK_ARGV = (sys.executable, "-m", "transfer.serving.ranks.rank_process")
STOP_TIMEOUT_S = 10.0
HEARTBEAT_WINDOW_S = 10 * HEARTBEAT_S  # a rank silent this long is frozen or dead

logger = logging.getLogger(__name__)

Wrap = Callable[[list[str]], list[str]]


def rank_env() -> dict[str, str]:
    """This environment, with the checkout on PYTHONPATH so a rank imports this code."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


class Pending(Generic[R]):
    """A command sent to the ranks whose answer may not have come back yet."""

    def __init__(self, link: RankLink, seq: int, what: str) -> None:
        self.link, self.seq, self.what = link, seq, what

    def result(self, timeout_s: float = 300.0) -> list[R]:
        """The per-rank results in rank order (waits for them)."""
        return self.link.result(self, timeout_s)


class RankLink:
    """The control side of the connection to rank 0: typed calls with timeouts.

    Commands may be pipelined: `submit` sends one without waiting, so a command can wait
    at the rank while the one before it runs. Rank 0 runs them in arrival order and tags
    each answer with its command's index. Any thread may wait for any pending command; one thread at a time reads the connection
    and files each answer under its command.
    """

    def __init__(
        self, conn: Connection, label: str = "ranks", beating: Callable[[], bool] | None = None
    ) -> None:
        self.conn = conn
        self.label = label
        self.beating = beating  # whether every rank still beats (None: no heartbeats)
        self.dead = ""
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._sent = 0  # commands sent; the next one's index (rank 0 counts the same)
        self._reading = False  # a thread is reading the connection
        self._answers: dict[int, list[Any]] = {}  # by command index: read, not yet claimed

    def submit(self, command: RankCommand[R]) -> Pending[R]:
        """Send `command` to every rank without waiting for its answer."""
        with self._send_lock:
            if self.dead:
                raise RankGroupDead(self.dead)
            try:
                self.conn.send(command)
            except (OSError, EOFError) as exc:
                self.dead = f"{self.label}: rank 0 is gone ({exc})"
                raise RankGroupDead(self.dead) from None
            pending: Pending[R] = Pending(self, self._sent, type(command).__name__)
            self._sent += 1
        return pending

    def call(self, command: RankCommand[R], timeout_s: float = 300.0) -> list[R]:
        """Run `command` on every rank; the per-rank results in rank order."""
        return self.submit(command).result(timeout_s)

    def result(self, pending: Pending[R], timeout_s: float) -> list[R]:
        """The answer to `pending`; whoever waits reads the answers that come first."""
        while True:
            with self._cond:
                while pending.seq not in self._answers and self._reading and not self.dead:
                    self._cond.wait()
                if pending.seq in self._answers:
                    return _checked(pending.what, self._answers.pop(pending.seq))
                if self.dead:
                    raise RankGroupDead(self.dead)
                self._reading = True
            try:
                index, answer = self._read_answer(pending.what, timeout_s)
                with self._cond:
                    self._answers[index] = answer
            finally:
                with self._cond:
                    self._reading = False
                    self._cond.notify_all()

    def receive(self, what: str, timeout_s: float) -> list[Any]:
        """The next per-rank results (the answer to `what`), read before any command."""
        return _checked(what, self._read_answer(what, timeout_s))

    def _read_answer(self, what: str, timeout_s: float) -> Any:
        try:
            waited, warned = 0.0, False
            while not self.conn.poll(min(timeout_s, HEARTBEAT_WINDOW_S)):
                waited += min(timeout_s, HEARTBEAT_WINDOW_S)
                if waited < timeout_s:
                    continue
                # Past the timeout: slow is not dead. Wait on while every rank beats.
                if self.beating is None or not self.beating():
                    self.dead = f"{self.label}: no answer to {what} within {waited:g}s"
                    raise RankGroupDead(self.dead)
                if not warned:
                    logger.warning("%s: %s is slow (%.0fs); every rank still beats",
                                   self.label, what, waited)  # fmt: skip
                    warned = True
            return self.conn.recv()
        except RankGroupDead:
            raise
        except (EOFError, OSError) as exc:
            self.dead = f"{self.label}: rank processes died during {what} ({type(exc).__name__})"
            raise RankGroupDead(self.dead) from None

    def stop(self, wait_s: float = 0.0) -> None:
        """Ask the ranks to stop (no answer comes), wait up to `wait_s` for rank 0 to close
        its end, and close the connection. Commands still waiting for answers get
        `RankGroupDead`."""
        with self._send_lock, self._cond:
            while self._reading:  # a reader owns the connection until its answer is in
                self._cond.wait()
            if not self.dead:
                with contextlib.suppress(OSError, EOFError):
                    self.conn.send(Stop())
                    deadline = time.monotonic() + wait_s
                    while self.conn.poll(max(0.0, deadline - time.monotonic())):
                        self.conn.recv()  # EOFError once rank 0 has gone
            self.dead = self.dead or f"{self.label}: closed"
            self.conn.close()
            self._cond.notify_all()


def _checked(what: str, results: list[Any]) -> list[Any]:
    failures = [r for r in results if isinstance(r, RankFailure)]
    if failures:
        raise command_error(what, failures)
    return results


class RankGroup:
    """Starts this node's ranks of one group and, when rank 0 is here, commands them.

    `specs` (each with `.rank`, `.tp`, `.device`) are this node's ranks; `build` names the
    function that makes a rank's worker ("module:function", so the control process need not
    import it). `dist_init` is the group's rendezvous (default: a free local port when the
    group has more than one rank). `rank0_socket` hands rank 0 a connection someone else
    commands (then this object has no `link`); `wrap` wraps each rank's argv.
    """

    def __init__(
        self,
        specs: Sequence[Any],
        build: str,
        *,
        dist_init: str | None = None,
        rank0_socket: socket.socket | None = None,
        wrap: Wrap | None = None,
        label: str = "ranks",
        start_timeout_s: float = 300.0,
    ) -> None:
        if dist_init is None and any(spec.tp > 1 for spec in specs):
            dist_init = f"tcp://127.0.0.1:{free_port()}"
        self.link: RankLink | None = None
        self.procs: list[subprocess.Popen] = []
        self._beats = tempfile.mkdtemp(prefix="pdxfer-beats-")
        self._beat_paths: list[str] = []
        self._ranks: list[int] = []  # the rank of each process in `procs`
        self.ready: list[Any] | None = None
        try:
            for spec in specs:
                self._start(spec, build, dist_init, rank0_socket, wrap, label)
            if self.link is not None:
                self.ready = self.link.receive("start", start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, spec, build, dist_init, rank0_socket, wrap, label) -> None:
        theirs = None
        if spec.rank == 0:
            theirs = rank0_socket
            if theirs is None:
                ours, theirs = socket.socketpair()
                self.link = RankLink(Connection(ours.detach()), label, self.beating)
        fds = (theirs.fileno(),) if theirs is not None else ()
        argv = list(RANK_ARGV)
        proc = subprocess.Popen(
            wrap(argv) if wrap else argv, stdin=subprocess.PIPE, env=rank_env(), cwd=ROOT,
            pass_fds=fds,
        )  # fmt: skip
        self.procs.append(proc)
        beat = os.path.join(self._beats, f"rank{spec.rank}")
        self._beat_paths.append(beat)
        self._ranks.append(spec.rank)
        launch = RankLaunch(spec, build, dist_init, os.getpid(), fds[0] if fds else None, beat)
        try:
            pickle.dump(launch, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            proc.stdin.close()
        except OSError:
            pass  # it died at once; the start answer (or `alive`) says so
        finally:
            if theirs is not None:
                theirs.close()  # the child holds it; EOF on ours then means it died

    def beating(self) -> bool:
        """Whether every rank process here touched its heartbeat file lately (a frozen or
        dead one has not)."""
        return not self.silent_ranks()

    def silent_ranks(self) -> list[int]:
        """The ranks here that have not touched their heartbeat file within
        HEARTBEAT_WINDOW_S (frozen, or dead)."""
        now = time.time()
        silent = []
        for spec_rank, proc, path in zip(self._ranks, self.procs, self._beat_paths, strict=True):
            try:
                if now - os.stat(path).st_mtime > HEARTBEAT_WINDOW_S or proc.poll() is not None:
                    silent.append(spec_rank)
            except OSError:
                silent.append(spec_rank)
        return silent

    @property
    def alive(self) -> bool:
        dead = self.link is not None and bool(self.link.dead)
        return not dead and all(p.poll() is None for p in self.procs)

    def call(self, command: RankCommand[R], timeout_s: float = 300.0) -> list[R]:
        """Run `command` on every rank of the group; the per-rank results in rank order."""
        return self.submit(command).result(timeout_s)

    def submit(self, command: RankCommand[R]) -> Pending[R]:
        """Send `command` to every rank of the group; its answer comes from `.result()`.
        Commands run in the order they were sent."""
        if self.link is None:
            raise RankGroupDead("only the node holding rank 0 commands the group")
        return self.link.submit(command)

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for every rank process to exit; whether they all did."""
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return False
        return True

    def close(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the ranks (politely, then SIGTERM, then SIGKILL)."""
        if self.link is not None:
            self.link.stop()
        self.join(timeout_s)
        shutil.rmtree(self._beats, ignore_errors=True)
        for proc in self.procs:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if proc.poll() is not None:
                    break
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(3.0)
