"""TP rank processes of one instance, and the control process's handle on them.

The control process talks to rank 0 over a pipe. Rank 0 broadcasts every command to the
group (gloo), every rank runs it on its own shard, and rank 0 gathers the per-rank results
and sends them back. Ranks on other nodes (multi-node TP) therefore need no pipe: they
follow rank 0's broadcasts. Commands run one at a time, in the same order on every rank,
which is what the model's collectives require.

A rank that raises answers `RankFailure` for that command and keeps serving; a rank process
that dies takes the group down (its peers fail in the next collective), and every later call
raises `RankGroupDead`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from transfer.control.errors import ControlError

logger = logging.getLogger(__name__)

STOP = "stop"
# Ranks wait for commands inside a collective; an idle server must not time them out.
GROUP_TIMEOUT_S = 7 * 24 * 3600.0


class RankGroupDead(ControlError):
    """The rank processes are gone; the instance cannot serve any more (UNAVAILABLE)."""

    def __init__(self, details: str):
        super().__init__("UNAVAILABLE", details)


@dataclass(frozen=True)
class RankFailure:
    """What a rank answers when its command raised."""

    rank: int
    kind: str  # exception class name
    message: str
    bad_input: bool = False  # a ValueError: the caller's fault, not the rank's


class RankCommandError(RuntimeError):
    """A command failed on at least one rank; `failures` says where and why."""

    def __init__(self, command: str, failures: list[RankFailure]):
        first = failures[0]
        super().__init__(f"{command} failed on rank {first.rank}: {first.kind}: {first.message}")
        self.command = command
        self.failures = failures

    @property
    def kind(self) -> str:
        return self.failures[0].kind


class RankInputError(RankCommandError, ValueError):
    """Every failing rank rejected its input (answers INVALID_ARGUMENT)."""


def die_with_parent() -> None:
    """SIGTERM this process when its parent exits (Linux), so no rank outlives its server."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _resolve(build: str):
    module, _, name = build.partition(":")
    return getattr(importlib.import_module(module), name)


def rank_main(spec: Any, conn, build: str) -> None:
    """Body of one rank process. `build` ("module:function") names `f(spec, group)`, which
    returns an object whose methods are the commands; `conn` is the pipe to the control
    process (rank 0 only, else None). Naming it keeps torch out of the control process."""
    die_with_parent()
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        return  # the control process died before we could ask to die with it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the control process decides when to stop
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{spec.rank} %(message)s")
    from transfer.model.distributed import init_tp_group

    group = init_tp_group(
        spec.rank,
        spec.tp,
        spec.dist_init if spec.tp > 1 else None,
        device=spec.device,
        timeout_s=GROUP_TIMEOUT_S,
    )
    try:
        try:
            worker = _resolve(build)(spec, group)
            ready: Any = None
        except Exception as exc:
            worker = None
            ready = RankFailure(
                spec.rank, type(exc).__name__, _describe(exc), isinstance(exc, ValueError)
            )
        _serve_commands(spec.rank, group, conn, worker, ready)
    finally:
        group.close()


def _serve_commands(rank: int, group, conn, worker, ready) -> None:
    results = _gather(group, ready)
    if conn is not None:
        conn.send(results)
    if any(isinstance(r, RankFailure) for r in results):
        if worker is not None and hasattr(worker, "close"):
            worker.close()
        return  # every rank saw the failure: the group cannot serve
    try:
        while True:
            command = conn.recv() if conn is not None else None
            command = group.broadcast_object(command, src=0)
            if command is None or command[0] == STOP:
                break
            name, args = command
            try:
                result = getattr(worker, name)(*args)
            except Exception as exc:
                if not isinstance(exc, ValueError):
                    logger.error("command %s failed:\n%s", name, traceback.format_exc())
                result = RankFailure(
                    rank, type(exc).__name__, _describe(exc), isinstance(exc, ValueError)
                )
            after = getattr(worker, "after_command", None)
            if after is not None:
                try:
                    after()
                except Exception:
                    logger.error("after_command failed:\n%s", traceback.format_exc())
            results = _gather(group, result)
            if conn is not None:
                conn.send(results)
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # the control process is gone
    finally:
        close = getattr(worker, "close", None)
        if close is not None:
            close()


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _gather(group, value: Any) -> list[Any]:
    if not (group.distributed and group.size > 1):
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * group.size
    dist.all_gather_object(out, value, group=group.group)
    return out


class RankGroup:
    """Starts the local ranks of one instance and runs commands on all ranks of the group.

    `specs` are this node's ranks; the one with rank 0 (if here) gets the pipe. Only the node
    holding rank 0 may call `call`.
    """

    def __init__(self, specs: list[Any], build: str, start_timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._conn = None
        self._dead = ""
        self.procs: list[mp.Process] = []
        for spec in specs:
            conn = None
            if spec.rank == 0:
                self._conn, conn = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main, args=(spec, conn, build), name=f"pdxfer-rank{spec.rank}"
            )
            proc.start()
            if conn is not None:
                conn.close()  # the child holds its end; EOF on ours then means it died
            self.procs.append(proc)
        self.ready = self._receive("start", start_timeout_s) if self._conn else None

    @property
    def alive(self) -> bool:
        return not self._dead and all(p.is_alive() for p in self.procs)

    def call(self, name: str, *args: Any, timeout_s: float = 300.0) -> list[Any]:
        """Run `name(*args)` on every rank; the per-rank results in rank order."""
        if self._conn is None:
            raise RuntimeError("call: only the node holding rank 0 commands the group")
        with self._lock:
            if self._dead:
                raise RankGroupDead(self._dead)
            try:
                self._conn.send((name, args))
            except (OSError, EOFError) as exc:
                self._dead = f"rank 0 is gone ({exc})"
                raise RankGroupDead(self._dead) from None
            return self._receive(name, timeout_s)

    def _receive(self, name: str, timeout_s: float) -> list[Any]:
        try:
            if not self._conn.poll(timeout_s):
                self._dead = f"ranks did not answer {name} within {timeout_s:g}s"
                raise RankGroupDead(self._dead)
            results = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._dead = f"rank processes died during {name} ({type(exc).__name__})"
            raise RankGroupDead(self._dead) from None
        failures = [r for r in results if isinstance(r, RankFailure)]
        if failures:
            if all(f.bad_input for f in failures):
                raise RankInputError(name, failures)
            raise RankCommandError(name, failures)
        return results

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the ranks (politely, then SIGTERM, then SIGKILL)."""
        with self._lock:
            if self._conn is not None and not self._dead:
                with contextlib.suppress(OSError, EOFError):
                    self._conn.send((STOP, ()))
            self._dead = self._dead or "closed"
        for proc in self.procs:
            proc.join(timeout_s)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(3.0)
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(3.0)
        if self._conn is not None:
            self._conn.close()
