"""One prefill or decode rank of `pdxfer bench transfer`, as its own process.

It owns an arena (a flat uint8 tensor) and a transport, and obeys the driver: commands
arrive on stdin and answers leave on stdout, each a 4-byte length and a pickle. Pipes
cross network namespaces, so the driver commands ranks inside `ip netns exec` too.
Anything a library prints goes to stderr: stdout carries only answers.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import time
import traceback
import zlib
from typing import Any, BinaryIO

HEADER = struct.Struct("<Q")
POLL_SLEEP_S = 20e-6
# Prefill arenas repeat a seeded random pattern of this (odd-sized) period: a misplaced
# range goes unnoticed only if it is off by a multiple of it, and tiling is ~10x faster
# than generating every byte.
PATTERN_PERIOD = (1 << 24) + 8


def write_message(stream: BinaryIO, message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


def read_exactly(stream: BinaryIO, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_message(stream: BinaryIO) -> Any:
    """The next message, or None at end of stream."""
    header = read_exactly(stream, HEADER.size)
    if header is None:
        return None
    body = read_exactly(stream, HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


class Rank:
    """The commands (`cmd_*`) one rank answers. A job is prepared once and run many times."""

    def __init__(self) -> None:
        self.arena = None
        self.transport = None
        self.jobs: dict[str, Any] = {}

    def cmd_setup(
        self, role: str, name: str, arena_bytes: int, backend: str, options: dict, seed: int
    ) -> bytes:
        """Allocate the arena (prefill: random bytes), register it; return transport metadata."""
        import torch

        from transfer.dataplane import make_transport

        # Ranks share the box's cores: intra-op threads only add wake-up latency (a 720 KiB
        # staging copy took 6-8 ms with 2 threads on 2 busy cores, 0.1 ms with 1).
        torch.set_num_threads(1)
        self.arena = torch.empty(arena_bytes, dtype=torch.uint8)
        if role == "prefill":
            generator = torch.Generator().manual_seed(seed)
            period = min(arena_bytes, PATTERN_PERIOD)
            pattern = torch.randint(0, 256, (period,), dtype=torch.uint8, generator=generator)
            for start in range(0, arena_bytes, period):
                end = min(arena_bytes, start + period)
                self.arena[start:end] = pattern[: end - start]
        else:
            self.arena.zero_()
        self.transport = make_transport(backend, name, **options)
        return self.transport.register(self.arena)

    def cmd_add_peers(self, metadata: list[bytes]) -> list[str]:
        return [self.transport.add_peer(m) for m in metadata]

    def cmd_prepare(self, job: str, kind: str, items: list) -> None:
        """`kind` "gather" (prefill): `items` are SourcePlans whose gathers to run. "read"
        (decode): `(peer, RangeBatch, SourcePlan | None)`: READ each batch, then scatter."""
        if kind not in ("gather", "read"):
            raise ValueError(f"kind: expected 'gather' or 'read', got {kind!r}")
        self.jobs[job] = (kind, items)

    def cmd_drop(self, job: str) -> None:
        self.jobs.pop(job, None)

    def cmd_run(self, job: str, deadline_s: float) -> float:
        """Run a prepared job once; its wall time in seconds."""
        kind, items = self.jobs[job]
        if kind == "read":
            return self._read(items, deadline_s)
        from transfer.packer.staging import gather_staging

        start = time.perf_counter()
        for source in items:
            gather_staging(source, self.arena)
        return time.perf_counter() - start

    def _read(self, work: list, deadline_s: float) -> float:
        from transfer.dataplane import Op
        from transfer.packer.staging import scatter_staging

        transport = self.transport
        start = time.perf_counter()
        pending = [
            transport.post(Op.READ, peer, batch, deadline_s=deadline_s) for peer, batch, _ in work
        ]
        handles = list(pending)
        while pending:
            still = []
            for handle in pending:
                status = transport.poll(handle)
                if status.failed:
                    for h in handles:
                        transport.release(h)
                    raise RuntimeError(f"transfer failed: {status.reason}")
                if status.pending:
                    still.append(handle)
            pending = still
            if pending:
                time.sleep(POLL_SLEEP_S)
        for _, _, staged in work:
            if staged is not None:
                scatter_staging(staged, self.arena)
        elapsed = time.perf_counter() - start
        for handle in handles:
            transport.release(handle)
        return elapsed

    def cmd_checksum(self, groups: list[tuple[Any, Any]]) -> list[int]:
        """CRC32 of the bytes at `(offsets, lengths)` of each group, ranges in the given order."""
        data = self.arena.numpy()
        sums = []
        for offsets, lengths in groups:
            crc = 0
            for offset, length in zip(offsets.tolist(), lengths.tolist(), strict=True):
                crc = zlib.crc32(data[offset : offset + length], crc)
            sums.append(crc)
        return sums

    def cmd_zero(self) -> None:
        self.arena.zero_()

    def cmd_close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


def main() -> int:
    # The driver owns shutdown: on Ctrl-C it closes every rank, then removes namespaces.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    commands = sys.stdin.buffer
    rank = Rank()
    while True:
        message = read_message(commands)
        if message is None:
            rank.cmd_close()
            return 0
        command, kwargs = message
        try:
            result = getattr(rank, f"cmd_{command}")(**kwargs)
            write_message(answers, ("ok", result))
        except Exception as exc:
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            print(traceback.format_exc(), file=sys.stderr)
            write_message(answers, ("error", detail))
        if command == "close":
            return 0


if __name__ == "__main__":
    sys.exit(main())
