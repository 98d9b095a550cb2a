"""One prefill or decode rank of `pdxfer bench transfer`, and the commands it answers.

The ranks run on the workers' rank-process framework (`transfer.serving.ranks`): one group
per side, commanded through its rank 0. A rank owns an arena (a flat uint8 tensor) and a
transport. A job (the READs or gathers of one mode) is prepared once and run many times.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Any

from transfer.serving.rank_protocol import RankCommand

BUILD = "transfer.bench.transfer_rank:build_bench_rank"
POLL_SLEEP_S = 20e-6
# Prefill arenas repeat a seeded random pattern of this (odd-sized) period: a misplaced
# range goes unnoticed only if it is off by a multiple of it, and tiling is ~10x faster
# than generating every byte.
PATTERN_PERIOD = (1 << 24) + 8


@dataclass(frozen=True)
class BenchRankSpec:
    """What one rank process builds itself from."""

    role: str  # "prefill" | "decode"
    name: str  # transport agent name
    rank: int
    tp: int
    arena_bytes: int
    backend: str
    options: tuple[tuple[str, str], ...]  # transport options (tls, net_devices)
    seed: int
    device: str = "cpu"


@dataclass(frozen=True)
class ReadItem:
    """One READ batch of a decode rank's job, and the staged plan to scatter after it."""

    prefill_rank: int
    batch: Any  # RangeBatch
    staged: Any = None  # SourcePlan whose scatter follows the READ, or None


def build_bench_rank(spec: BenchRankSpec, group) -> BenchRank:
    """The `build` function each rank process runs."""
    return BenchRank(spec)


class BenchRank:
    def __init__(self, spec: BenchRankSpec) -> None:
        import torch

        from transfer.dataplane import make_transport

        # Ranks share the box's cores: intra-op threads only add wake-up latency (a 720 KiB
        # staging copy took 6-8 ms with 2 threads on 2 busy cores, 0.1 ms with 1).
        torch.set_num_threads(1)
        self.spec = spec
        self.arena = torch.empty(spec.arena_bytes, dtype=torch.uint8)
        if spec.role == "prefill":
            generator = torch.Generator().manual_seed(spec.seed)
            period = min(spec.arena_bytes, PATTERN_PERIOD)
            pattern = torch.randint(0, 256, (period,), dtype=torch.uint8, generator=generator)
            for start in range(0, spec.arena_bytes, period):
                end = min(spec.arena_bytes, start + period)
                self.arena[start:end] = pattern[: end - start]
        else:
            self.arena.zero_()
        self.transport = make_transport(spec.backend, spec.name, **dict(spec.options))
        self.metadata = self.transport.register(self.arena)
        self.peers: list[str] = []
        self.jobs: dict[str, tuple[str, tuple]] = {}

    def add_peers(self, metadata: tuple[bytes, ...]) -> None:
        self.peers = [self.transport.add_peer(m) for m in metadata]

    def prepare(self, job: str, kind: str, items: tuple) -> None:
        """`kind` "gather" (prefill): `items` are SourcePlans whose gathers to run. "read"
        (decode): `ReadItem`s: READ each batch, then scatter. "stream" (decode): `(ready_s,
        ReadItems)` per group: each group is posted `ready_s` after the run starts."""
        if kind not in ("gather", "read", "stream"):
            raise ValueError(f"kind: expected 'gather', 'read' or 'stream', got {kind!r}")
        self.jobs[job] = (kind, items)

    def run(self, job: str, deadline_s: float) -> float:
        """Run a prepared job once; its wall time in seconds (0 for a job this rank lacks)."""
        if job not in self.jobs:
            return 0.0
        kind, items = self.jobs[job]
        if kind == "read":
            return self._read(items, deadline_s)
        if kind == "stream":
            return self._stream(items, deadline_s)
        from transfer.packer.staging import gather_staging

        start = time.perf_counter()
        for source in items:
            gather_staging(source, self.arena)
        return time.perf_counter() - start

    def _read(self, items: tuple[ReadItem, ...], deadline_s: float) -> float:
        from transfer.dataplane import Op
        from transfer.packer.staging import scatter_staging

        transport = self.transport
        start = time.perf_counter()
        handles = [
            transport.post(Op.READ, self.peers[i.prefill_rank], i.batch, deadline_s=deadline_s)
            for i in items
        ]
        pending = list(handles)
        try:
            while pending:
                pending = self._still_pending(pending)
                if pending:
                    time.sleep(POLL_SLEEP_S)
            for item in items:
                if item.staged is not None:
                    scatter_staging(item.staged, self.arena)
            return time.perf_counter() - start
        finally:
            for handle in handles:
                transport.release(handle)

    def _stream(self, groups: tuple[tuple[float, tuple[ReadItem, ...]], ...], deadline_s: float):
        """Post each group's READs once its modelled ready time has passed, then wait for
        all; seconds from the last group's ready time (the end of the modelled prefill) to
        the last byte: the exposed transfer time."""
        from transfer.dataplane import Op

        transport = self.transport
        start = time.perf_counter()
        end_of_prefill = max(ready for ready, _ in groups)
        waiting, pending, handles = list(groups), [], []
        try:
            while waiting or pending:
                now = time.perf_counter() - start
                while waiting and waiting[0][0] <= now:
                    for item in waiting.pop(0)[1]:
                        peer = self.peers[item.prefill_rank]
                        handle = transport.post(Op.READ, peer, item.batch, deadline_s=deadline_s)
                        handles.append(handle)
                        pending.append(handle)
                pending = self._still_pending(pending)
                if pending:
                    time.sleep(POLL_SLEEP_S)
                elif waiting:  # nothing in flight: sleep until the next group is ready
                    time.sleep(max(0.0, waiting[0][0] - (time.perf_counter() - start)))
            return time.perf_counter() - start - end_of_prefill
        finally:
            for handle in handles:
                transport.release(handle)

    def _still_pending(self, handles: list[int]) -> list[int]:
        """The handles not yet DONE; raises if any failed."""
        still = []
        for handle in handles:
            status = self.transport.poll(handle)
            if status.failed:
                raise RuntimeError(f"transfer failed: {status.reason}")
            if status.pending:
                still.append(handle)
        return still

    def checksum(self, groups: tuple) -> list[int]:
        """CRC32 of the bytes at `(offsets, lengths)` of each group, ranges in the given order."""
        data = self.arena.numpy()
        sums = []
        for offsets, lengths in groups:
            crc = 0
            for offset, length in zip(offsets.tolist(), lengths.tolist(), strict=True):
                crc = zlib.crc32(data[offset : offset + length], crc)
            sums.append(crc)
        return sums

    def close(self) -> None:
        self.transport.close()


@dataclass(frozen=True)
class BenchInfo(RankCommand[bytes]):
    """This rank's transport metadata."""

    def apply(self, worker: BenchRank) -> bytes:
        return worker.metadata


@dataclass(frozen=True)
class BenchAddPeers(RankCommand[None]):
    metadata: tuple[bytes, ...]  # of every prefill rank

    def apply(self, worker: BenchRank) -> None:
        worker.add_peers(self.metadata)


@dataclass(frozen=True)
class Prepare(RankCommand[None]):
    job: str
    kind: str  # "gather" | "read"
    items: tuple[tuple, ...]  # per rank

    def apply(self, worker: BenchRank) -> None:
        mine = self.items[worker.spec.rank]
        if mine:
            worker.prepare(self.job, self.kind, mine)


@dataclass(frozen=True)
class Drop(RankCommand[None]):
    job: str

    def apply(self, worker: BenchRank) -> None:
        worker.jobs.pop(self.job, None)


@dataclass(frozen=True)
class Run(RankCommand[float]):
    job: str
    deadline_s: float

    def apply(self, worker: BenchRank) -> float:
        return worker.run(self.job, self.deadline_s)


@dataclass(frozen=True)
class Checksum(RankCommand[list]):
    groups: tuple[tuple, ...]  # per rank: (offsets, lengths) arrays

    def apply(self, worker: BenchRank) -> list[int]:
        return worker.checksum(self.groups[worker.spec.rank])


@dataclass(frozen=True)
class Zero(RankCommand[None]):
    def apply(self, worker: BenchRank) -> None:
        worker.arena.zero_()
