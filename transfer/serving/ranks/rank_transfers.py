"""One rank's transfers: pdxfer's engine on top of the shared `TransferAgent`.

The agent registers the arena, posts and polls the READs and tracks what may still move
bytes; this side adds what pdxfer's engine asks of a rank: peers per prefill instance with
a warm-up READ, staging gathers and scatters, a layer-wise stream's progress reader, and a
status per request. It reaches the model through two callbacks only: `mark_filling` when a
transfer starts and `mark_ready` once every byte landed (docs/bugs.md, bugs 4 and 6). A
transfer that failed or was abandoned reports its slot reusable only once none of its
READs can still land (bug 14).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from transfer.agent import Finished, PeerReads, TransferAgent
from transfer.agent.staging import Packed, StagingArea, check_copies, gather_to_staging
from transfer.cache.layout import Layout
from transfer.dataplane import RangeBatch
from transfer.dataplane.metadata import PeerInfo
from transfer.locking import locked
from transfer.serving.ranks.commands import RankTransferStatus, StreamSource, TransferState
from transfer.serving.ranks.progress import entry_offset
from transfer.serving.ranks.spec import WARMUP_BYTES, Copies, RankReads
from transfer.serving.ranks.stream_reader import ProgressReader

# A whole transfer of at most SETTLE_MAX_BYTES is polled for up to TRANSFER_SETTLE_S by
# `start` itself (0.4-0.8 ms p50 for a tiny model's request over NIXL on one host); a
# bigger one would only spend that time waiting.
TRANSFER_SETTLE_S = 0.002
SETTLE_MAX_BYTES = 4 << 20
SETTLE_POLL_S = 0.0001
WARMUP_DEADLINE_S = 30.0
# A warm-up READ fails by its deadline; this bounds the wait should the transport not say.
WARMUP_GRACE_S = 5.0
WARMUP_POLL_S = 0.0005
# Agent keys of warm-up READs; request ids never start with a NUL.
_WARMUP_KEY = "\0warm-up"


@dataclass
class _Transfer:
    slot: int
    posted_at: float  # time.monotonic() on this rank
    instance: str  # the prefill instance it reads from
    status: RankTransferStatus = RankTransferStatus(TransferState.PENDING)
    sealed: bool = True  # a stream is sealed by its last `post`
    reader: ProgressReader | None = None  # a stream's progress, on its reading rank


class RankTransfers:
    """The transfers into and out of one rank's arena. Thread-safe, one call at a time: a
    rank may start or poll a transfer beside the step its command loop runs."""

    def __init__(
        self,
        agent: TransferAgent,
        buffer: torch.Tensor,
        layout: Layout,
        rank: int,
        mark_filling: Callable[[int, list[int]], None],
        mark_ready: Callable[[int], None],
    ) -> None:
        """`buffer`: the arena, uint8 [layout.arena_bytes], registered with `agent` here."""
        self.agent = agent
        self.buffer = buffer
        self.layout = layout
        self.area = StagingArea.of(layout)
        self.rank = rank
        self.mark_filling = mark_filling
        self.mark_ready = mark_ready
        self.metadata = agent.register_arena(buffer)
        self.peers: dict[str, list[str]] = {}  # prefill instance -> peer name of each rank
        self.transfers: dict[str, _Transfer] = {}
        self.finished: dict[str, Finished] = {}  # what the agent finished, until `end`
        self._lock = threading.RLock()

    # -- handshake ------------------------------------------------------------------------

    @locked
    def add_peers(self, instance: str, metadata: list[bytes], staging: list[int]) -> None:
        """Connect to every rank of prefill instance `instance` (again, after a restart):
        a small READ from each one's staging area (`staging`: arena offsets) sets up the
        connection now rather than in the first request's transfer."""
        self._check_names(instance, [PeerInfo.decode(m).name for m in metadata])
        peers = [self.agent.connect(m) for m in metadata]
        local = self.layout.staging_offset
        for peer, remote in zip(peers, staging, strict=True):
            read = PeerReads(peer, RangeBatch.single(local, remote, WARMUP_BYTES))
            error = self._read_now(f"{_WARMUP_KEY}/{instance}/{peer}", read)
            if error:
                raise ConnectionError(f"prefill {instance} ({peer}) unreachable: {error}")
        self.peers[instance] = peers

    def _check_names(self, instance: str, names: list[str]) -> None:
        """The transport keeps one peer per agent name, so a second instance under a name
        already taken would silently take over the first one's READs."""
        for other, taken in self.peers.items():
            clash = set(names) & set(taken)
            if other != instance and clash:
                raise ValueError(
                    f"metadata: prefill {instance} names its agent {sorted(clash)[0]!r}, as "
                    f"prefill {other} does; give each instance its own agent prefix"
                )

    def _read_now(self, key: str, read: PeerReads) -> str:
        """Post `read` and wait for it; why it failed, or ""."""
        try:
            self.agent.post(key, [read], deadline_s=WARMUP_DEADLINE_S, strict=True)
        except Exception:
            self.agent.abandon(key)
            raise
        give_up = time.monotonic() + WARMUP_DEADLINE_S + WARMUP_GRACE_S
        while time.monotonic() < give_up:
            self._poll_agent()
            done = self.finished.pop(key, None)
            if done is not None:
                return done.error
            time.sleep(WARMUP_POLL_S)
        self.agent.abandon(key)
        return f"no answer in {WARMUP_DEADLINE_S + WARMUP_GRACE_S:.0f} s"

    # -- the source side ------------------------------------------------------------------

    @locked
    def stage_gather(self, copies: Copies) -> None:
        """Pack cache ranges back to back into the staging area (`copies.dst` consecutive),
        done before this returns: the decode side READs them next."""
        gather_to_staging(self.buffer, self.area, copies)

    # -- the reading side -----------------------------------------------------------------

    @locked
    def start(
        self,
        request_id: str,
        instance: str,
        reads: tuple[RankReads, ...],
        slot: int,
        block_ids: list[int],
        deadline_s: float,
        stream: StreamSource | None = None,
    ) -> RankTransferStatus:
        """Mark `slot`/`block_ids` FILLING and post this rank's READs from `instance`; a
        `stream` stays open for `post` and reads the prefill ranks' progress. A small whole
        transfer is polled for up to `TRANSFER_SETTLE_S` before answering its status: most
        land that fast, and a DONE now saves the caller a `poll`, which would wait behind
        the decode step the ranks run next."""
        if request_id in self.transfers:
            raise ValueError(f"request_id {request_id!r}: a transfer is already in flight")
        if instance not in self.peers:
            raise ValueError(f"instance {instance!r}: no handshake with it yet")
        mine = reads[self.rank]
        if len(mine.scatter):
            check_copies(self.area, mine.scatter, Packed.SRC)
        peers = self.peers[instance]
        reader = None
        if stream is not None and stream.reader_rank == self.rank:
            if len(stream.entries) != len(peers):
                raise ValueError(f"stream.entries: {len(stream.entries)} for {len(peers)} ranks")
            local = [entry_offset(self.layout, slot, r) for r in range(len(peers))]
            reader = ProgressReader(self.agent.transport, peers, stream.entries, local,
                                    self.buffer, deadline_s)  # fmt: skip
        self.mark_filling(slot, block_ids)
        transfer = _Transfer(slot, time.monotonic(), instance, sealed=stream is None,
                             reader=reader)  # fmt: skip
        self.transfers[request_id] = transfer
        try:
            # The agent unpacks the staged part once every READ landed.
            scatter = mine.scatter
            self.agent.post(request_id, _peer_reads(peers, mine),
                            (scatter.src, scatter.dst, scatter.nbytes), deadline_s=deadline_s,
                            sealed=transfer.sealed, strict=True)  # fmt: skip
            if reader is not None:
                reader.advance()
        except Exception:
            self.end(request_id)
            raise
        nbytes = sum(int(batch.nbytes.sum()) for batch in mine.batches)
        settle_until = time.monotonic() + TRANSFER_SETTLE_S
        while transfer.sealed and nbytes <= SETTLE_MAX_BYTES:
            self._poll_agent()
            self._advance(request_id, transfer)
            if transfer.status.state is not TransferState.PENDING or (
                time.monotonic() >= settle_until
            ):
                break
            time.sleep(SETTLE_POLL_S)
        return transfer.status

    @locked
    def post(self, request_id: str, reads: tuple[RankReads, ...], last: bool) -> None:
        """Post more READs of an open stream; `last` seals it."""
        transfer = self._transfer(request_id)
        if transfer.sealed:
            raise ValueError(f"request_id {request_id!r}: the transfer is not an open stream")
        peers = self.peers[transfer.instance]
        self.agent.extend(request_id, _peer_reads(peers, reads[self.rank]), last)
        if last:
            transfer.sealed = True
            self._stop_reader(request_id, transfer)

    @locked
    def poll(self, request_id: str) -> RankTransferStatus:
        """Once DONE the slot is READY. A finished transfer keeps its status until `end`."""
        transfer = self._transfer(request_id)
        self._poll_agent()
        self._advance(request_id, transfer)
        return transfer.status

    @locked
    def advance_all(self) -> None:
        """Notice finished transfers early (run after every rank command)."""
        if not self.transfers:
            return
        self._poll_agent()
        for request_id, transfer in self.transfers.items():
            self._advance(request_id, transfer)

    def _poll_agent(self) -> None:
        for finished in self.agent.poll():
            self.finished[finished.key] = finished

    def _advance(self, request_id: str, transfer: _Transfer) -> None:
        if transfer.status.state is not TransferState.PENDING:
            return
        finished = self.finished.get(request_id)
        failure = finished.error if finished is not None else self.agent.failure(request_id)
        reasons = [failure] if failure else []
        reader = transfer.reader
        if reader is not None:
            reader.advance()
            if reader.failure:
                reasons.append(reader.failure)
        if reasons:
            # The key stays with the agent: a failed READ may still land (NIXL cannot
            # cancel one in flight), so `end` reports whether the slot is reusable.
            self._stop_reader(request_id, transfer)
            transfer.status = RankTransferStatus(TransferState.FAILED, reason="; ".join(reasons))
        elif not transfer.sealed:
            if reader is not None:
                transfer.status = RankTransferStatus(TransferState.PENDING, progress=reader.words)
        elif finished is not None:
            self.mark_ready(transfer.slot)
            seconds = time.monotonic() - transfer.posted_at
            transfer.status = RankTransferStatus(TransferState.DONE, seconds)

    @locked
    def end(self, request_id: str) -> bool:
        """Forget a transfer. True when none of its READs can still move bytes, so its slot
        and blocks may be reused; otherwise keep asking `settled`. A slot whose transfer
        did not finish stays FILLING until the model side releases it."""
        transfer = self.transfers.pop(request_id, None)
        if transfer is not None:
            self._stop_reader(request_id, transfer)
        self.finished.pop(request_id, None)
        return self.agent.abandon(request_id)

    @locked
    def settled(self, request_id: str) -> bool:
        """Release the request's READs that can no longer move bytes; True when none remain."""
        return self.agent.settled(request_id)

    def _stop_reader(self, request_id: str, transfer: _Transfer) -> None:
        """A stream's progress READs stop; any still in flight settle with the transfer's."""
        if transfer.reader is not None:
            self.agent.adopt(request_id, transfer.reader.stop())
            transfer.reader = None

    def _transfer(self, request_id: str) -> _Transfer:
        try:
            return self.transfers[request_id]
        except KeyError:
            raise ValueError(f"request_id {request_id!r}: no transfer in flight") from None

    @locked
    def close(self) -> None:
        for request_id in list(self.transfers):
            self.end(request_id)
        self.agent.close()  # closing the transport ends whatever still moves


def _peer_reads(peers: Sequence[str], mine: RankReads) -> list[PeerReads]:
    return [
        PeerReads(peers[b.prefill_rank], RangeBatch(b.local, b.remote, b.nbytes))
        for b in mine.batches
    ]
