"""`TransferAgent`: one rank's reads, from registration to "nothing can still land".

It knows memory regions, peers and planned byte ranges; no model, no engine, no control
plane. An engine (pdxfer's rank worker, vLLM's connector) registers its memory once,
connects to peers by their transport metadata, posts a plan's reads under a key (a request
id) and polls. A key finishes only when every one of its transfers has settled: done, or
failed with nothing left in flight (docs/bugs.md, bug 14) -- so the caller may hand the
destination memory back to its engine the moment it sees the key.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from transfer.dataplane import Op, RangeBatch, Transport
from transfer.errors import InvalidInput, WrongState
from transfer.packer import TransferPlan

DEFAULT_DEADLINE_S = 60.0


@dataclass(frozen=True)
class PeerReads:
    """The reads of one key from one peer: `local`/`remote` offsets and lengths."""

    peer: str
    ranges: RangeBatch


@dataclass(frozen=True)
class Finished:
    """A key whose transfers all settled. `error` is empty when every byte landed."""

    key: str
    error: str
    nbytes: int
    descriptors: int
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass
class _Pending:
    handles: list[int]
    nbytes: int
    descriptors: int
    started: float
    copies: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    errors: list[str] = field(default_factory=list)


def plan_reads(plan: TransferPlan, peers: Sequence[str]) -> list[PeerReads]:
    """A decode rank's plan as reads: `peers[p]` is the connected name of prefill rank `p`.
    Staged plans need gathers the caller arranges; this agent posts wire ranges only."""
    reads = []
    for source in plan.sources:
        if len(source.gather) or len(source.scatter):
            raise InvalidInput("plan: staged sources need a staging exchange (not supported)")
        if len(source.wire):
            wire = source.wire
            reads.append(
                PeerReads(peers[source.prefill_rank], RangeBatch(wire.dst, wire.src, wire.lengths))
            )
    return reads


class TransferAgent:
    """Posts and polls one rank's reads. Not thread-safe: one owner thread calls it."""

    def __init__(self, transport: Transport, deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        if not (isinstance(deadline_s, int | float) and deadline_s > 0):
            raise InvalidInput(f"deadline_s: expected a positive number, got {deadline_s!r}")
        self.transport = transport
        self.deadline_s = float(deadline_s)
        self.metadata: bytes | None = None
        self._peers: dict[bytes, str] = {}
        self._pending: dict[str, _Pending] = {}
        self._regions: list[torch.Tensor] = []

    def register(self, regions: Sequence[torch.Tensor]) -> bytes:
        """Register the rank's memory once (uint8 regions); returns its transport metadata."""
        if self.metadata is not None:
            raise WrongState("agent: memory is already registered")
        self._regions = list(regions)
        self.metadata = self.transport.register_regions(self._regions)
        return self.metadata

    def connect(self, metadata: bytes) -> str:
        """The peer described by `metadata` (connected once, then cached)."""
        name = self._peers.get(metadata)
        if name is None:
            name = self.transport.add_peer(metadata)
            self._peers[metadata] = name
        return name

    def post(
        self,
        key: str,
        reads: Sequence[PeerReads],
        copies: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Start `reads` under `key`; once all landed, run the local `copies` (staging
        offset, destination offset, nbytes; virtual offsets, `transfer.agent.staging`). A
        post that fails part-way leaves the key failed; it still finishes only once what
        was posted has settled."""
        if key in self._pending:
            raise WrongState(f"key {key!r}: already has transfers in flight")
        pending = _Pending(
            [], sum(r.ranges.total_bytes for r in reads), 0, time.monotonic(), copies
        )
        self._pending[key] = pending
        for read in reads:
            try:
                handle = self.transport.post(
                    Op.READ, read.peer, read.ranges, deadline_s=self.deadline_s
                )
            except Exception as exc:  # a peer gone, ranges refused: the key fails
                pending.errors.append(f"posting to {read.peer}: {exc}")
                break
            pending.handles.append(handle)
            pending.descriptors += len(read.ranges)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def poll(self) -> list[Finished]:
        """Keys whose transfers have all settled since the last call."""
        finished = []
        for key, pending in list(self._pending.items()):
            unsettled = []
            for handle in pending.handles:
                status = self.transport.poll(handle)
                if status.pending or (status.failed and not status.settled):
                    unsettled.append(handle)
                    continue
                if status.failed:
                    pending.errors.append(status.reason)
                self.transport.release(handle)
            pending.handles = unsettled
            if unsettled:
                continue
            del self._pending[key]
            if not pending.errors and pending.copies is not None and len(pending.copies[2]):
                self._copy(*pending.copies)
            finished.append(
                Finished(
                    key,
                    "; ".join(pending.errors),
                    pending.nbytes,
                    pending.descriptors,
                    time.monotonic() - pending.started,
                )
            )
        return finished

    def _copy(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """Local copies between registered regions, in virtual offsets."""
        region_map = self.transport.region_map
        if region_map is None:
            raise WrongState("agent: local copies need registered regions")
        s_index = region_map.indices(src, nbytes, "copies.src")
        d_index = region_map.indices(dst, nbytes, "copies.dst")
        starts = [r.start for r in region_map.regions]
        rows = zip(
            s_index.tolist(),
            src.tolist(),
            d_index.tolist(),
            dst.tolist(),
            nbytes.tolist(),
            strict=True,
        )
        for si, s, di, d, n in rows:
            s -= starts[si]
            d -= starts[di]
            self._regions[di][d : d + n].copy_(self._regions[si][s : s + n])

    def close(self) -> None:
        self.transport.close()
