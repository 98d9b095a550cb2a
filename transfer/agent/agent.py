"""`TransferAgent`: one rank's reads, from registration to "nothing can still land".

It knows memory regions, peers and planned byte ranges; no model, no engine, no control
plane. An engine (pdxfer's rank worker, vLLM's connector) registers its memory once,
connects to peers by their transport metadata, posts a plan's reads under a key (a request
id) and polls. A key finishes only when every one of its transfers has settled: done, or
failed with nothing left in flight (docs/bugs.md, bug 14) -- so the caller may hand the
destination memory back to its engine the moment it sees the key.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from transfer.agent.staging import copy_within
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
    deadline_at: float = math.inf  # time.monotonic() past which no READ may be posted
    sealed: bool = True  # an open key (a stream) takes more reads and cannot finish yet
    failed: set[int] = field(default_factory=set)  # handles whose failure is in `errors`


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
        self._arena: torch.Tensor | None = None  # set by `register_arena`
        self._abandoned: dict[str, list[int]] = {}  # key -> transfers that may still move bytes

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

    def register_arena(self, arena: torch.Tensor) -> bytes:
        """Register one arena (uint8 [nbytes]) instead of regions: offsets are arena offsets."""
        if self.metadata is not None:
            raise WrongState("agent: memory is already registered")
        self.metadata = self.transport.register(arena)
        self._arena = arena
        return self.metadata

    def post(
        self,
        key: str,
        reads: Sequence[PeerReads],
        copies: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
        deadline_s: float | None = None,
        sealed: bool = True,
        strict: bool = False,
    ) -> None:
        """Start `reads` under `key`; once all landed, run the local `copies` (staging
        offset, destination offset, nbytes; offsets as the reads', `transfer.agent.staging`).
        No READ is posted later than `deadline_s` (default: the agent's) from now. A post
        that fails part-way leaves the key failed; it still finishes only once what was
        posted has settled. `sealed=False` opens a stream that `extend` adds to and seals.
        `strict`: a refused post also raises, after the key is marked failed."""
        if key in self._pending:
            raise WrongState(f"key {key!r}: already has transfers in flight")
        now = time.monotonic()
        deadline_at = now + (self.deadline_s if deadline_s is None else deadline_s)
        pending = _Pending([], 0, 0, now, copies, deadline_at=deadline_at, sealed=sealed)
        self._pending[key] = pending
        self._post(pending, reads, strict)

    def extend(self, key: str, reads: Sequence[PeerReads], last: bool, strict: bool = True) -> None:
        """Post more reads of the open stream `key` (within its deadline); `last` seals it."""
        pending = self._pending.get(key)
        if pending is None or pending.sealed:
            raise WrongState(f"key {key!r}: not an open stream")
        self._post(pending, reads, strict)
        pending.sealed = last

    def _post(self, pending: _Pending, reads: Sequence[PeerReads], strict: bool) -> None:
        deadline_s = pending.deadline_at - time.monotonic()
        if deadline_s <= 0 and reads:
            raise InvalidInput("transfer: past its deadline, no READ may be posted")
        pending.nbytes += sum(r.ranges.total_bytes for r in reads)
        for read in reads:
            try:
                handle = self.transport.post(Op.READ, read.peer, read.ranges, deadline_s=deadline_s)
            except Exception as exc:  # a peer gone, ranges refused: the key fails
                pending.errors.append(f"posting to {read.peer}: {exc}")
                if strict:
                    raise
                break
            pending.handles.append(handle)
            pending.descriptors += len(read.ranges)

    def adopt(self, key: str, handles: Sequence[int]) -> None:
        """Settle `handles` (transfers posted on `self.transport` by someone else, e.g. a
        stream's progress reads) with `key`: it finishes, or settles, only after them too."""
        if key in self._pending:
            self._pending[key].handles.extend(handles)
        else:
            self._abandoned.setdefault(key, []).extend(handles)

    def failure(self, key: str) -> str:
        """Why `key` failed, as far as the last `poll` saw ("" while nothing failed). Bytes
        may still land: the key finishes, or settles, only later."""
        pending = self._pending.get(key)
        return "; ".join(pending.errors) if pending is not None else ""

    def abandon(self, key: str) -> bool:
        """Stop waiting for `key`: it will not finish, nor run its copies. True when none of
        its transfers can still move bytes, so its memory may be reused; otherwise ask
        `settled` again."""
        pending = self._pending.pop(key, None)
        if pending is not None and pending.handles:
            self._abandoned.setdefault(key, []).extend(pending.handles)
        return self.settled(key)

    def settled(self, key: str) -> bool:
        """Release the abandoned `key`'s transfers that can no longer move bytes; True when
        none remain."""
        remaining = []
        for handle in self._abandoned.pop(key, []):
            status = self.transport.poll(handle)
            if status.pending or not status.settled:
                remaining.append(handle)
            else:
                with contextlib.suppress(ValueError):
                    self.transport.release(handle)
        if remaining:
            self._abandoned[key] = remaining
        return not remaining

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
                if status.failed and handle not in pending.failed:
                    pending.failed.add(handle)
                    pending.errors.append(status.reason)
                if status.pending or (status.failed and not status.settled):
                    unsettled.append(handle)
                    continue
                pending.failed.discard(handle)
                self.transport.release(handle)
            pending.handles = unsettled
            if unsettled or not pending.sealed:
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

    def copy_local(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """Copy now between this rank's registered memory (virtual offsets, as `post`'s
        copies); done when this returns."""
        self._copy(src, dst, nbytes)

    def zero_local(self, offsets: np.ndarray, nbytes: np.ndarray) -> None:
        """Zero ranges of this rank's registered regions (virtual offsets) now."""
        region_map = self.transport.region_map
        if region_map is None:
            raise WrongState("agent: zeroing needs registered regions")
        index = region_map.indices(offsets, nbytes, "zero.offsets")
        starts = [r.start for r in region_map.regions]
        for i, at, n in zip(index.tolist(), offsets.tolist(), nbytes.tolist(), strict=True):
            self._regions[i][at - starts[i] : at - starts[i] + n].zero_()

    def _copy(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """Local copies inside the registered arena, or between registered regions (in
        virtual offsets)."""
        if self._arena is not None:
            copy_within(self._arena, src, dst, nbytes)
            return
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
        """Close the transport: whatever still moves ends with it."""
        self._pending.clear()
        self._abandoned.clear()
        self.transport.close()
