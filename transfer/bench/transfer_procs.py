"""The driver's handle on rank processes: start, command over pipes or a socket with
timeouts, stop."""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transfer.bench.transfer_rank import HEADER

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0
ROOT = str(Path(__file__).resolve().parents[2])
RANK_ARGV = [sys.executable, "-m", "transfer.bench.transfer_rank"]


def rank_env() -> dict[str, str]:
    """This environment, with the checkout on PYTHONPATH so the rank imports this code."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


class RankError(RuntimeError):
    """A rank process failed a command, died, or did not answer in time."""


class RankHandle:
    """Commands one rank over a byte stream; subclasses supply the stream."""

    label: str

    def _write(self, data: bytes) -> None:
        raise NotImplementedError

    def _fileno(self) -> int:
        raise NotImplementedError

    def _recv(self, n: int) -> bytes:
        raise NotImplementedError

    def _exit(self) -> str:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def send(self, command: str, **kwargs: Any) -> None:
        body = pickle.dumps((command, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._write(HEADER.pack(len(body)) + body)
        except OSError as exc:
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
        fd = self._fileno()
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankError(f"{self.label}: no answer to {command!r} within {timeout_s:g} s")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = self._recv(min(n - got, 1 << 20))
            if not chunk:
                raise RankError(f"{self.label}: exited during {command!r} ({self._exit()})")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def ask_to_close(self) -> None:
        if self._exit() == "still running":
            with contextlib.suppress(RankError):
                self.send("close")


class RankProcess(RankHandle):
    """`python -m transfer.bench.transfer_rank`, optionally wrapped (e.g. `ip netns exec`)."""

    def __init__(self, label: str, wrap: Callable[[list[str]], list[str]] | None = None) -> None:
        self.label = label
        self.proc = subprocess.Popen(
            wrap(RANK_ARGV) if wrap else RANK_ARGV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=rank_env(),
            cwd=ROOT,
        )

    def _write(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def _fileno(self) -> int:
        return self.proc.stdout.fileno()

    def _recv(self, n: int) -> bytes:
        return os.read(self.proc.stdout.fileno(), n)

    def _exit(self) -> str:
        code = self.proc.poll()
        return "still running" if code is None else f"exit status {code}"

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


class RankSocket(RankHandle):
    """A rank on another node, behind `pdxfer bench transfer --node-rank 0`: a connected
    socket that has passed the rank host's token check (see transfer_remote)."""

    def __init__(self, label: str, sock: socket.socket) -> None:
        self.label, self.sock, self.closed = label, sock, False

    def _write(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fileno(self) -> int:
        return self.sock.fileno()

    def _recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def _exit(self) -> str:
        return "connection closed" if self.closed else "still running"

    def stop(self) -> None:
        """Ask politely, then end the stream (the host closes the rank's stdin) and wait for
        the host to close its side, so the rank is gone before the next pair starts."""
        self.ask_to_close()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        with contextlib.suppress(OSError):
            while time.monotonic() < deadline:
                ready, _, _ = select.select([self.sock], [], [], 0.5)
                if ready and not self.sock.recv(1 << 16):
                    break
        self.closed = True
        self.sock.close()


def call_all(
    ranks: Sequence[RankHandle],
    command: str,
    timeout_s: float,
    per_rank: Sequence[dict] | None = None,
) -> list:
    """Send `command` to every rank first (so they run together), then collect the answers."""
    per_rank = per_rank or [{} for _ in ranks]
    for rank, kwargs in zip(ranks, per_rank, strict=True):
        rank.send(command, **kwargs)
    return [rank.receive(command, timeout_s) for rank in ranks]


def stop_all(ranks: Sequence[RankHandle]) -> None:
    for rank in ranks:
        rank.ask_to_close()
    for rank in ranks:
        rank.stop()
