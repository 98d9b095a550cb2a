"""Shared by the dataplane tests: a seeded byte pattern, random range batches, and a peer
process that owns a transport and an arena and obeys commands sent over a pipe."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import signal
from typing import Any

import numpy as np

from transfer.dataplane import RangeBatch

_CHUNK_WORDS = 1 << 20
START_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 60.0


def pattern(seed: int, start: int, nbytes: int) -> np.ndarray:
    """Bytes [start, start + nbytes) of an endless seeded pattern: uint8 [nbytes]. Byte o is
    byte o % 8 of a 64-bit mix of o // 8, so a misplaced range never matches."""
    out = np.empty(nbytes, dtype=np.uint8)
    first, last = start // 8, (start + nbytes - 1) // 8
    pos = 0
    for lo in range(first, last + 1, _CHUNK_WORDS):
        x = np.arange(lo, min(lo + _CHUNK_WORDS, last + 1), dtype=np.uint64)
        x ^= np.uint64((seed * 0x9E3779B97F4A7C15) % 2**64)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        chunk = x.view(np.uint8)[start - 8 * first if lo == first else 0 :]
        take = min(len(chunk), nbytes - pos)
        out[pos : pos + take] = chunk[:take]
        pos += take
    return out


def fill(arena: Any, seed: int, windows: list[tuple[int, int]]) -> None:
    """Write the pattern into each [lo, hi) window of a uint8 tensor; the rest stays untouched."""
    import torch

    for lo, hi in windows:
        arena[lo:hi] = torch.from_numpy(pattern(seed, lo, hi - lo))


def _scatter(rng: np.random.Generator, sizes: np.ndarray, window: tuple[int, int]) -> np.ndarray:
    """Non-overlapping offsets for `sizes` inside `window`, in random order with random gaps."""
    lo, hi = window
    slack = hi - lo - int(sizes.sum())
    assert slack >= 0, "window too small for the ranges"
    order = rng.permutation(len(sizes))
    gaps = rng.multinomial(slack, np.full(len(sizes) + 1, 1 / (len(sizes) + 1)))[: len(sizes)]
    ends = lo + np.cumsum(sizes[order] + gaps)
    offsets = np.empty(len(sizes), dtype=np.int64)
    offsets[order] = ends - sizes[order]
    return offsets


def random_ranges(
    rng: np.random.Generator,
    count: int,
    max_nbytes: int,
    local_window: tuple[int, int],
    remote_window: tuple[int, int],
    min_nbytes: int = 1,
) -> RangeBatch:
    """`count` ranges, non-overlapping on each side, in shuffled order. Sizes are
    log-uniform in [min_nbytes, max_nbytes], and both extremes occur."""
    logs = rng.uniform(np.log(min_nbytes), np.log(max_nbytes + 1), count)
    sizes = np.clip(np.exp(logs).astype(np.int64), min_nbytes, max_nbytes)
    sizes[rng.choice(count, min(count, 2), replace=False)] = [min_nbytes, max_nbytes][
        : min(count, 2)
    ]
    return RangeBatch(
        _scatter(rng, sizes, local_window), _scatter(rng, sizes, remote_window), sizes
    )


def digest(arena: Any, offsets: np.ndarray, nbytes: np.ndarray) -> str:
    """blake2b of the ranges' bytes, concatenated in order."""
    data = arena.numpy() if hasattr(arena, "numpy") else arena
    h = hashlib.blake2b(digest_size=16)
    for offset, size in zip(offsets.tolist(), nbytes.tolist(), strict=True):
        h.update(data[offset : offset + size].data)
    return h.hexdigest()


def expect_pattern(arena: Any, ranges: RangeBatch, seed: int) -> None:
    """Assert that each local range holds the pattern of its remote range."""
    data = arena.numpy()
    for i, (lo, ro, n) in enumerate(
        zip(ranges.local.tolist(), ranges.remote.tolist(), ranges.nbytes.tolist(), strict=True)
    ):
        if not np.array_equal(data[lo : lo + n], pattern(seed, ro, n)):
            raise AssertionError(f"range {i} ({lo}, {ro}, {n}) does not hold the peer's bytes")


def _peer_main(conn: Any, backend: str, name: str, arena_bytes: int, windows: list, seed: int, options: dict, env: dict) -> None:  # fmt: skip
    os.environ.update(env)
    import torch

    from transfer.dataplane import make_transport

    transport = make_transport(backend, name, **options)
    arena = torch.empty(arena_bytes, dtype=torch.uint8)
    fill(arena, seed, windows)
    conn.send(("ok", transport.register(arena)))
    inbox: list[tuple[str, bytes]] = []
    open_ = True
    while True:
        if not conn.poll(0.02):
            if open_:
                inbox += [(n.peer, n.message) for n in transport.notifications()]
            continue
        try:
            command, args = conn.recv()
        except EOFError:
            return
        try:
            if command == "exit":
                transport.close()
                conn.send(("ok", None))
                return
            if command == "add_peer":
                result: Any = transport.add_peer(args[0])
            elif command == "digest":
                result = digest(arena, np.asarray(args[0]), np.asarray(args[1]))
            elif command == "notifications":
                result, inbox = inbox + [(n.peer, n.message) for n in transport.notifications()], []
            elif command == "close_transport":
                transport.close()
                open_ = False
                result = None
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", result))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class PeerProcess:
    """A spawned process holding one transport and one arena with the seeded pattern in
    `windows`. `metadata` is its transport's metadata."""

    def __init__(
        self,
        backend: str,
        name: str,
        arena_bytes: int,
        windows: list[tuple[int, int]],
        seed: int,
        options: dict | None = None,
        env: dict | None = None,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_peer_main,
            args=(child, backend, name, arena_bytes, windows, seed, options or {}, env or {}),
            daemon=True,
        )
        self.process.start()
        child.close()
        self.name = name
        self.metadata: bytes = self._reply(START_TIMEOUT_S)

    def _reply(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            self.kill()
            raise TimeoutError(f"peer {self.name!r} did not answer within {timeout_s} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            self.process.join(10)
            raise RuntimeError(f"peer {self.name!r} exited ({self.process.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"peer {self.name!r}: {value}")
        return value

    def call(self, command: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        self._conn.send((command, args))
        return self._reply(timeout_s)

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError, EOFError, TimeoutError, RuntimeError):
                self.call("exit", timeout_s=20)
            self.process.join(10)
        self.kill()
        self._conn.close()
