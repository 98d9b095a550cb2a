"""Body of one rank process (`python -m transfer.serving.ranks.rank_process`).

It reads a pickled `RankLaunch` on stdin, joins its group, builds its worker, and runs
commands until told to stop. Rank 0 receives each command on its connection (a socket to
the control process, or to the driver on another node) and broadcasts it to the group;
every rank runs it, and rank 0 gathers the per-rank results and sends them back. Ranks
other than 0 therefore need no connection: they follow rank 0's broadcasts. A command that
overtakes runs ahead of the commands waiting, or, in a group of one, at once beside the
one running (`rank_inbox`).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from transfer.serving.child_process import die_with_parent
from transfer.serving.ranks.rank_inbox import Inbox, Lanes
from transfer.serving.ranks.rank_protocol import HEARTBEAT_S, RankFailure, RankLaunch, Stop

logger = logging.getLogger(__name__)

# Ranks wait for commands inside a collective; an idle server must not time them out.
GROUP_TIMEOUT_S = 7 * 24 * 3600.0
BESIDE_STOP_S = 10.0  # longest wait for the command running beside the loop, at the end


def _beat(path: str) -> None:
    """Touch `path` every HEARTBEAT_S: the control process tells a slow rank (still beating,
    a long command) from a dead or frozen one (silent)."""
    while True:
        with contextlib.suppress(OSError), open(path, "a"):
            os.utime(path)
        time.sleep(HEARTBEAT_S)


def _resolve(build: str):
    module, _, name = build.partition(":")
    return getattr(importlib.import_module(module), name)


def main() -> int:
    launch: RankLaunch = pickle.load(sys.stdin.buffer)
    die_with_parent(launch.parent_pid)
    if launch.heartbeat:
        threading.Thread(target=_beat, args=(launch.heartbeat,), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the control process decides when to stop
    spec = launch.spec
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{spec.rank} %(message)s")
    conn = Connection(launch.conn_fd) if launch.conn_fd is not None else None
    from transfer.model.distributed import init_tp_group

    group = init_tp_group(
        spec.rank, spec.tp, launch.dist_init, device=spec.device, timeout_s=GROUP_TIMEOUT_S
    )
    try:
        try:
            worker = _resolve(launch.build)(spec, group)
            ready: Any = None
        except Exception as exc:
            logger.error("building the rank failed:\n%s", traceback.format_exc())
            worker, ready = None, RankFailure.of(spec.rank, exc)
        _serve(spec.rank, group, conn, worker, ready)
    finally:
        group.close()
        if conn is not None:
            conn.close()
    return 0


def _serve(rank: int, group, conn: Connection | None, worker, ready) -> None:
    results = _gather(group, ready)
    if conn is not None:
        _send(conn, results)
    if any(isinstance(r, RankFailure) for r in results):
        _close(worker)
        return  # every rank saw the failure: the group cannot serve
    sending = threading.Lock()  # the loop and the beside thread both answer

    def answer(message: Any) -> None:
        with sending:
            _send(conn, message)

    inbox: Inbox | Lanes | None = None  # rank 0's; the others follow its broadcasts
    if conn is not None and not (group.distributed and group.size > 1):
        inbox = Lanes(conn, lambda command: run_command(rank, command, worker), answer,
                      getattr(worker, "bind_thread", None))  # fmt: skip
    elif conn is not None:
        inbox = Inbox(conn)
    try:
        while True:
            index, command = inbox.next() if inbox is not None else (None, None)
            command = group.broadcast_object(command, src=0)
            if isinstance(command, Stop):
                break
            result = run_command(rank, command, worker)
            after = getattr(worker, "after_command", None)
            if after is not None:
                try:
                    after()
                except Exception:
                    logger.error("after_command failed:\n%s", traceback.format_exc())
            results = _gather(group, result)
            if conn is not None:
                answer((index, results))
    except KeyboardInterrupt:
        pass
    finally:
        if isinstance(inbox, Lanes):
            inbox.close(BESIDE_STOP_S)
        _close(worker)


def run_command(rank: int, command: Any, worker) -> Any:
    """`command`'s result on this rank, or the RankFailure it raised."""
    try:
        return command.apply(worker)
    except Exception as exc:
        if not isinstance(exc, ValueError):
            logger.error("%s failed:\n%s", type(command).__name__, traceback.format_exc())
        return RankFailure.of(rank, exc)


def _send(conn: Connection, results: list[Any]) -> None:
    with contextlib.suppress(OSError):  # the control process is gone: the next receive stops
        conn.send(results)


def _close(worker) -> None:
    close = getattr(worker, "close", None)
    if close is not None:
        close()


def _gather(group, value: Any) -> list[Any]:
    if not (group.distributed and group.size > 1):
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * group.size
    dist.all_gather_object(out, value, group=group.group)
    return out


if __name__ == "__main__":
    sys.exit(main())
