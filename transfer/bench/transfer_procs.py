"""The driver's handle on rank processes: start, command over pipes with timeouts, stop."""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transfer.bench.transfer_rank import HEADER, write_message

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0


class RankError(RuntimeError):
    """A rank process failed a command, died, or did not answer in time."""


class RankProcess:
    """`python -m transfer.bench.transfer_rank`, optionally wrapped (e.g. `ip netns exec`)."""

    def __init__(self, label: str, wrap: Callable[[list[str]], list[str]] | None = None) -> None:
        self.label = label
        argv = [sys.executable, "-m", "transfer.bench.transfer_rank"]
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            wrap(argv) if wrap else argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=root,
        )

    def send(self, command: str, **kwargs: Any) -> None:
        try:
            write_message(self.proc.stdin, (command, kwargs))
        except (BrokenPipeError, OSError) as exc:
            raise RankError(
                f"{self.label}: cannot send {command!r} ({self._exit()}): {exc}"
            ) from None

    def receive(self, command: str, timeout_s: float) -> Any:
        header = self._read(HEADER.size, command, timeout_s)
        status, value = pickle.loads(self._read(HEADER.unpack(header)[0], command, timeout_s))
        if status != "ok":
            raise RankError(f"{self.label}: {command} failed: {value}")
        return value

    def call(self, command: str, timeout_s: float = 120.0, **kwargs: Any) -> Any:
        self.send(command, **kwargs)
        return self.receive(command, timeout_s)

    def _read(self, n: int, command: str, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankError(f"{self.label}: no answer to {command!r} within {timeout_s:g} s")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                raise RankError(f"{self.label}: exited during {command!r} ({self._exit()})")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _exit(self) -> str:
        code = self.proc.poll()
        return "still running" if code is None else f"exit status {code}"

    def ask_to_close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(RankError):
                self.send("close")

    def stop(self) -> None:
        """Ask politely, then terminate, then kill."""
        self.ask_to_close()
        for step in (None, self.proc.terminate, self.proc.kill):
            if step is not None:
                step()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
                break
            except subprocess.TimeoutExpired:
                continue
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()


def call_all(
    ranks: Sequence[RankProcess],
    command: str,
    timeout_s: float,
    per_rank: Sequence[dict] | None = None,
) -> list:
    """Send `command` to every rank first (so they run together), then collect the answers."""
    per_rank = per_rank or [{} for _ in ranks]
    for rank, kwargs in zip(ranks, per_rank, strict=True):
        rank.send(command, **kwargs)
    return [rank.receive(command, timeout_s) for rank in ranks]


def stop_all(ranks: Sequence[RankProcess]) -> None:
    for rank in ranks:
        rank.ask_to_close()
    for rank in ranks:
        rank.stop()
