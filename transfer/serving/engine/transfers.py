"""A decode request's transfer as the engine drives it: planned, started, polled (a stream
posts more READs as the prefill ranks publish progress), then DONE or FAILED. Pure
bookkeeping: the engine sends the commands this asks for and feeds back the answers."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from transfer.serving.engine.peers import Peer
from transfer.serving.engine.stream import StreamPlanner
from transfer.serving.ranks.commands import (
    RankTransferStatus,
    StreamSource,
    TransferPost,
    TransferStart,
    TransferState,
)
from transfer.serving.ranks.spec import RankReads

POLL_INTERVAL_S = 0.0005  # between polls when no decode step paces them
# A stream polls this often until its prefill has finished: each poll is a rank command and
# a progress READ, and on a shared CPU they slow the prefill they wait for.
STREAM_POLL_S = 0.002
STREAM_HEARTBEAT_S = 0.5  # a stream's heartbeats also notice a failed prefill this soon


class Outcome(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass
class Transfer:
    """One request's READs into `blocks` (the blocks it reads: held prefix blocks are
    shared and read-only) and its slot."""

    peer: Peer
    reads: tuple[RankReads, ...]  # what the start posts (a stream: none; more follow)
    blocks: tuple[int, ...]
    kv_bytes: int = 0
    state_bytes: int = 0
    descriptors: int = 0
    first_token: int = -1
    first_logprob: float = 0.0
    planner: StreamPlanner | None = None
    source: StreamSource | None = None
    begin: float = field(default_factory=time.perf_counter)
    deadline: float = 0.0  # time.perf_counter() past which it failed
    sealed: bool = True  # a stream seals once its planner is complete
    finished_at: float | None = None  # a stream: the poll that saw its prefill finished
    polling: bool = False  # a start or poll at the ranks, not answered yet
    next_poll_at: float = 0.0
    outcome: Outcome = Outcome.PENDING
    failure: str = ""
    seconds: float = 0.0  # posting to done, the slowest rank (as the ranks measured it)

    def __post_init__(self) -> None:
        self.sealed = self.planner is None

    def start(self, request_id: str, slot: int, deadline_s: float) -> TransferStart:
        self.begin = time.perf_counter()
        self.deadline = self.begin + deadline_s
        self.polling = True
        return TransferStart(request_id, self.peer.instance_id, self.reads, slot, self.blocks,
                             deadline_s, self.source)  # fmt: skip

    def wants_poll(self, now: float) -> bool:
        return self.outcome is Outcome.PENDING and not self.polling and now >= self.next_poll_at

    def advance(self, request_id: str, statuses: list[RankTransferStatus]) -> TransferPost | None:
        """Take the ranks' statuses; a TransferPost to send when a stream has more READs."""
        now = time.perf_counter()
        self.polling = False
        waiting = self.planner is not None and self.finished_at is None
        self.next_poll_at = now + (STREAM_POLL_S if waiting else POLL_INTERVAL_S)
        failed = [f"rank {r}: {s.reason}" for r, s in enumerate(statuses)
                  if s.state is TransferState.FAILED]  # fmt: skip
        if failed:
            return self.fail("; ".join(failed))
        post = None
        if not self.sealed:
            planner = self.planner
            more = planner.advance(statuses[self.source.reader_rank].progress)
            if self.finished_at is None and (planner.finished or planner.complete):
                self.finished_at = now
            if more is not None or planner.complete:
                self.sealed = planner.complete
                post = TransferPost(request_id, more or self.reads, self.sealed)
        elif all(s.state is TransferState.DONE for s in statuses):
            self.outcome, self.seconds = Outcome.DONE, max(s.seconds for s in statuses)
            if self.planner is not None:
                self.kv_bytes, self.state_bytes = self.planner.kv_bytes, self.planner.state_bytes
                self.descriptors = self.planner.descriptors
                self.first_token, self.first_logprob = self.planner.first_pick
            return None
        if now > self.deadline:
            return self.fail(f"not done within {self.deadline - self.begin:g}s")
        return post

    def fail(self, reason: str) -> None:
        if self.outcome is Outcome.PENDING:
            self.outcome, self.failure = Outcome.FAILED, reason
            self.seconds = time.perf_counter() - self.begin
        return None

    def exposed_s(self, arrived: float) -> float:
        """What TTFT saw: from the prefill finishing (a stream) or the ticket's arrival (a
        whole transfer, which plans, stages and reads only then) to now."""
        since = self.finished_at if self.planner is not None else arrived
        return time.perf_counter() - (since if since is not None else arrived)
