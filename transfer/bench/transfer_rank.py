"""One prefill or decode rank of `pdxfer bench transfer`, and the commands it answers.

The ranks run on the workers' rank-process framework (`transfer.serving.ranks.ranks`): one group
per side, commanded through its rank 0. A rank owns an arena (a flat uint8 tensor) and the
same `TransferAgent` and staging copies serving uses (`transfer.agent`), so the bench times
the serving path, failure rule included: a failed job raises only once none of its READs
can still land. A job (the READs or gathers of one mode) is prepared once and run many
times.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from transfer.agent.staging import StagingArea
from transfer.serving.ranks.rank_protocol import RankCommand
from transfer.serving.ranks.spec import Copies
from transfer.serving.role import ServeRole

BUILD = "transfer.bench.transfer_rank:build_bench_rank"
POLL_SLEEP_S = 20e-6
# A job's READs end by its deadline; past it plus this, the rank gives up waiting.
GIVE_UP_GRACE_S = 10.0
# Prefill arenas repeat a seeded random pattern of this (odd-sized) period: a misplaced
# range goes unnoticed only if it is off by a multiple of it, and tiling is ~10x faster
# than generating every byte.
PATTERN_PERIOD = (1 << 24) + 8


@dataclass(frozen=True)
class BenchRankSpec:
    """What one rank process builds itself from."""

    role: ServeRole  # PREFILL or DECODE
    name: str  # transport agent name
    rank: int
    tp: int
    arena_bytes: int
    backend: str
    options: tuple[tuple[str, str], ...]  # transport options (tls, net_devices)
    seed: int
    device: str = "cpu"
    staging: StagingArea | None = None  # of the layout whose plans stage; None: no staging


@dataclass(frozen=True)
class ReadItem:
    """One READ batch of a decode rank's job, and the staged plan to scatter after it."""

    prefill_rank: int
    batch: Any  # RangeBatch
    staged: Any = None  # SourcePlan whose scatter follows the READ, or None


def build_bench_rank(spec: BenchRankSpec, group) -> BenchRank:
    """The `build` function each rank process runs."""
    return BenchRank(spec)


def _copies(ranges) -> Copies:
    """A plan's `Ranges` as staging copies (writable arrays, for `torch.from_numpy`)."""
    return Copies(ranges.src.copy(), ranges.dst.copy(), ranges.lengths.copy())


def _unpack(scatters: tuple[Copies, ...]) -> tuple | None:
    """The reading side's staged copies of a job, as the agent runs them after the READs."""
    if not scatters:
        return None
    return tuple(
        np.concatenate([getattr(c, f) for c in scatters]) for f in ("src", "dst", "nbytes")
    )


class BenchRank:
    def __init__(self, spec: BenchRankSpec) -> None:
        import torch

        from transfer.agent import TransferAgent
        from transfer.dataplane import make_transport

        # Ranks share the box's cores: intra-op threads only add wake-up latency (a 720 KiB
        # staging copy took 6-8 ms with 2 threads on 2 busy cores, 0.1 ms with 1).
        torch.set_num_threads(1)
        self.spec = spec
        self.arena = torch.empty(spec.arena_bytes, dtype=torch.uint8)
        if spec.role is ServeRole.PREFILL:
            generator = torch.Generator().manual_seed(spec.seed)
            period = min(spec.arena_bytes, PATTERN_PERIOD)
            pattern = torch.randint(0, 256, (period,), dtype=torch.uint8, generator=generator)
            for start in range(0, spec.arena_bytes, period):
                end = min(spec.arena_bytes, start + period)
                self.arena[start:end] = pattern[: end - start]
        else:
            self.arena.zero_()
        self.agent = TransferAgent(make_transport(spec.backend, spec.name, **dict(spec.options)))
        self.metadata = self.agent.register_arena(self.arena)
        self.peers: list[str] = []
        self.jobs: dict[str, tuple[str, tuple]] = {}

    def add_peers(self, metadata: tuple[bytes, ...]) -> None:
        self.peers = [self.agent.connect(m) for m in metadata]

    def prepare(self, job: str, kind: str, items: tuple) -> None:
        """`kind` "gather" (prefill): `items` are SourcePlans whose gathers to run. "read"
        (decode): `ReadItem`s: READ each batch, then scatter. "stream" (decode): `(ready_s,
        ReadItems)` per group: each group is posted `ready_s` after the run starts."""
        if kind not in ("gather", "read", "stream"):
            raise ValueError(f"kind: expected 'gather', 'read' or 'stream', got {kind!r}")
        from transfer.agent.staging import Packed, check_copies

        staged = [i.staged for i in items if i.staged is not None] if kind == "read" else items
        if kind != "stream" and staged and self.spec.staging is None:
            raise ValueError(f"job {job!r}: staged plans on a rank without a staging area")
        if kind == "gather":
            items = tuple(_copies(source.gather) for source in items if len(source.gather))
        elif kind == "read":
            scatters = tuple(_copies(source.scatter) for source in staged if len(source.scatter))
            for copies in scatters:
                check_copies(self.spec.staging, copies, Packed.SRC)
            items = (items, _unpack(scatters))
        self.jobs[job] = (kind, items)

    def run(self, job: str, deadline_s: float) -> float:
        """Run a prepared job once; its wall time in seconds (0 for a job this rank lacks)."""
        if job not in self.jobs:
            return 0.0
        kind, items = self.jobs[job]
        if kind == "read":
            return self._read(job, items, deadline_s)
        if kind == "stream":
            return self._stream(job, items, deadline_s)
        from transfer.agent.staging import gather_to_staging

        start = time.perf_counter()
        for copies in items:
            gather_to_staging(self.arena, self.spec.staging, copies)
        return time.perf_counter() - start

    def _reads(self, items: tuple[ReadItem, ...]) -> list:
        from transfer.agent import PeerReads

        return [PeerReads(self.peers[i.prefill_rank], i.batch) for i in items]

    def _read(self, job: str, items: tuple, deadline_s: float) -> float:
        """Post the READs and wait until every one landed and the agent unpacked the staged
        part."""
        reads, unpack = items
        start = time.perf_counter()
        self._transfer(job, deadline_s, lambda: self.agent.post(
            job, self._reads(reads), unpack, deadline_s=deadline_s, strict=True))  # fmt: skip
        return time.perf_counter() - start

    def _stream(self, job: str, groups: tuple[tuple[float, tuple[ReadItem, ...]], ...],
                deadline_s: float) -> float:  # fmt: skip
        """Post each group's READs once its modelled ready time has passed, then wait for
        all; seconds from the last group's ready time (the end of the modelled prefill) to
        the last byte: the exposed transfer time."""
        start = time.perf_counter()
        end_of_prefill = max(ready for ready, _ in groups)
        waiting = list(groups)

        def post_ready() -> None:
            now = time.perf_counter() - start
            while waiting and waiting[0][0] <= now:
                reads = self._reads(waiting.pop(0)[1])
                self.agent.extend(job, reads, last=not waiting)

        def open_stream() -> None:
            self.agent.post(job, [], deadline_s=deadline_s, sealed=False, strict=True)
            post_ready()

        self._transfer(job, deadline_s, open_stream, post_ready)
        return time.perf_counter() - start - end_of_prefill

    def _transfer(self, key: str, deadline_s: float, post, between=None) -> None:
        """`post` the job's READs under `key` and poll until all landed (`between` runs
        before each poll). A failure raises once nothing of the job can still land."""
        give_up = time.monotonic() + deadline_s + GIVE_UP_GRACE_S
        try:
            post()
            while time.monotonic() < give_up:
                if between is not None:
                    between()
                for finished in self.agent.poll():
                    if not finished.ok:
                        raise RuntimeError(f"transfer failed: {finished.error}")
                    return
                failure = self.agent.failure(key)
                if failure:
                    raise RuntimeError(f"transfer failed: {failure}")
                time.sleep(POLL_SLEEP_S)
            raise RuntimeError(f"transfer: not done {deadline_s + GIVE_UP_GRACE_S:.0f} s on")
        except BaseException:
            self._settle(key, give_up)
            raise

    def _settle(self, key: str, give_up: float) -> None:
        """Wait until none of `key`'s READs can still land (docs/bugs.md, bug 14)."""
        settled = self.agent.abandon(key)
        while not settled and time.monotonic() < give_up + GIVE_UP_GRACE_S:
            time.sleep(POLL_SLEEP_S)
            settled = self.agent.settled(key)
        if not settled:
            raise RuntimeError(f"transfer {key!r}: READs still in flight; the arena is unsafe")

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
        self.agent.close()


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
