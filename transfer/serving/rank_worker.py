"""What one TP rank process holds and does: its arena, transport agent and model shard.

Every public method backs a command of `transfer.serving.commands`, which the control
process runs on all ranks at once (`RankGroup.call`); each rank acts on its own shard and
answers for itself.

A transfer into this rank is asynchronous: `transfer_start` marks the slot and blocks
FILLING and posts the READs, later commands (decode steps of other requests) run while the
bytes land, and `transfer_poll` marks the slot READY only once every READ is DONE. A step
on a FILLING slot or block raises (docs/bugs.md, bug 6), and nothing on the decode side
ever starts a transferred slot from zeros (bug 4): only `prefill` does that.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from transfer.cache.arena import Arena
from transfer.cache.head_units import LayoutOptions
from transfer.cache.layout import Layout
from transfer.control.types import SamplingParams
from transfer.dataplane import Op, RangeBatch, make_transport, wait
from transfer.errors import InvalidInput
from transfer.model.batch import SequenceStep
from transfer.model.batch_runner import BatchEngine
from transfer.model.caches import ArenaCaches
from transfer.model.loader import load_model
from transfer.model.runner import RankEngine
from transfer.model.sampling import Sampler
from transfer.serving.commands import (
    DecodeStep,
    PrefillChunk,
    RankInfo,
    RankTransferStatus,
    StreamSource,
    TokenPick,
    TransferState,
)
from transfer.serving.cpu_rank import configure_cpu_rank
from transfer.serving.progress import entry_offset, progress_area_bytes
from transfer.serving.snapshots import save_snapshot, snapshot_request
from transfer.serving.spec import (
    WARMUP_BYTES,
    Copies,
    RankReads,
    RankSpec,
    staging_area_bytes,
)
from transfer.serving.staging_copies import (
    check_copies,
    gather_to_staging,
    scatter_from_staging,
)
from transfer.serving.stream_reader import ProgressReader
from transfer.serving.stream_writer import ProgressWriter, StreamedChunk

logger = logging.getLogger(__name__)

# A whole transfer of at most SETTLE_MAX_BYTES is polled for up to TRANSFER_SETTLE_S by
# `transfer_start` itself (0.4-0.8 ms p50 for a tiny model's request over NIXL on one
# host); a bigger one would only spend that time waiting.
TRANSFER_SETTLE_S = 0.002
SETTLE_MAX_BYTES = 4 << 20
SETTLE_POLL_S = 0.0001


@dataclass
class _Transfer:
    slot: int
    posted_at: float  # time.monotonic() on this rank
    scatter: Copies  # unpacks the staged part once every READ landed
    deadline_at: float  # time.monotonic() past which no READ may still be posted
    instance: str  # the prefill instance it reads from
    handles: list[int] = field(default_factory=list)
    status: RankTransferStatus = RankTransferStatus(TransferState.PENDING)
    sealed: bool = True  # a stream is sealed by its last `transfer_post`
    reader: ProgressReader | None = None  # a stream's progress, on its reading rank


def build_rank_worker(spec: RankSpec, group) -> RankWorker:
    """The `build` function `RankGroup` runs in each rank process."""
    return RankWorker(spec, group)


def layout_for(spec: RankSpec) -> Layout:
    staging = staging_area_bytes(spec.staging_bytes)
    return Layout.from_memplan(
        spec.geometry, spec.tp, spec.rank, spec.plan, spec.dtypes,
        LayoutOptions(layer_group=spec.layer_group), staging_bytes=staging,
        progress_bytes=progress_area_bytes(spec.plan.num_state_slots),
    )  # fmt: skip


class RankWorker:
    def __init__(self, spec: RankSpec, group) -> None:
        os.environ.update(dict(spec.env))
        self.spec = spec
        if spec.device == "cuda":
            torch.cuda.set_device(spec.local_rank)
            device = torch.device("cuda", spec.local_rank)
        else:
            device = torch.device("cpu")
            configure_cpu_rank()
        self.layout = layout_for(spec)
        self.arena = Arena.allocate(self.layout, device)
        self.arena.buffer.zero_()
        self.caches = ArenaCaches(self.arena)
        model = load_model(spec.model, group, device, seed=spec.seed)
        self.engine = RankEngine(spec.geometry, self.caches, group, spec.seed, device, model=model)
        self.batch = BatchEngine(self.engine)
        self.transport = make_transport(spec.transport, spec.agent_name)
        self.metadata = self.transport.register(self.arena.buffer)
        scribble = spec.stream_scribble_s if spec.rank == spec.tp - 1 else 0.0
        self.progress = ProgressWriter(self.arena.buffer, self.layout, scribble)
        self.peers: dict[str, list[str]] = {}  # prefill instance -> peer name of each rank
        self.transfers: dict[str, _Transfer] = {}
        # slot -> (position, token): what its last decode step picked, for a pipelined
        # step that names no token (sent before that pick came back to the control side).
        self.picked: dict[int, tuple[int, int]] = {}
        # READs of failed or abandoned transfers that may still move bytes (see settled).
        self.unsettled: dict[str, list[int]] = {}

    # -- handshake ------------------------------------------------------------------------

    def info(self) -> RankInfo:
        return RankInfo(self.metadata, json.dumps(self.layout.to_dict()).encode())

    def add_peers(self, instance: str, metadata: list[bytes], staging: list[int]) -> None:
        """Connect to every rank of prefill instance `instance` (again, after a restart):
        a small READ from each one's staging area (`staging`: arena offsets) sets up the
        connection now rather than in the first request's transfer."""
        peers = [self.transport.add_peer(m) for m in metadata]
        local = self.layout.staging_offset
        for peer, remote in zip(peers, staging, strict=True):
            batch = RangeBatch.single(local, remote, WARMUP_BYTES)
            status = wait(self.transport, self.transport.post(Op.READ, peer, batch, deadline_s=30))
            if not status.done:
                raise ConnectionError(f"prefill {instance} ({peer}) unreachable: {status.reason}")
        self.peers[instance] = peers

    # -- prefill side ---------------------------------------------------------------------

    def prefill_batch(self, chunks: Sequence[PrefillChunk]) -> tuple[TokenPick, ...]:
        for c in chunks:
            if c.restore_from >= 0:
                self.engine.copy_state(c.restore_from, c.slot)
            if c.copy_block >= 0:
                self.engine.copy_kv_rows(c.copy_block, c.block_ids, c.context_len)
        sequences = [SequenceStep(c.tokens, c.slot, c.block_ids, c.context_len) for c in chunks]
        samplers = [_sampler(c.sampling) for c in chunks]
        streamed = [
            StreamedChunk(c.slot, c.stream_key, c.context_len, c.context_len + len(c.tokens),
                          c.block_ids, c.ends_prompt)
            for c in chunks if c.stream_key
        ]  # fmt: skip
        after_layer = self.progress.after_layer(streamed)
        output = self.batch.step(sequences, samplers, [0] * len(chunks), after_layer)
        for c in chunks:
            if c.checkpoint_to >= 0:
                self.engine.copy_state(c.slot, c.checkpoint_to)
        if streamed:
            picks = [
                (p.token, p.logprob)
                for c, p in zip(chunks, output.picks, strict=True)
                if c.stream_key
            ]
            self.progress.stepped(streamed, picks)
        return tuple(TokenPick(p.token, p.logprob) for p in output.picks)

    def stage_gather(self, copies: Copies) -> None:
        """Pack cache ranges back to back into this rank's staging area (`copies.dst` are
        consecutive), done before this returns: the decode side READs them next."""
        gather_to_staging(self.arena.buffer, self.layout, copies)

    def snapshot(
        self, request_id: str, side: str, block_ids: list[int], slot: int, num_tokens: int
    ) -> None:
        """Write this rank's cache of the request for `launch --verify` (needs a dump dir)."""
        if not self.spec.dump_dir:
            raise ValueError("snapshot: this instance was started without --dump-dir")
        snap = snapshot_request(self.spec.geometry, self.caches, block_ids, slot, num_tokens)
        save_snapshot(self.spec.dump_dir, request_id, side, self.spec.rank, snap)

    def release(self, slot: int) -> None:
        self.engine.release(slot)
        self.picked.pop(slot, None)

    # -- decode side ----------------------------------------------------------------------

    def transfer_start(
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
        `stream` stays open for `transfer_post` and reads the prefill ranks' progress.
        A small whole transfer is polled for up to `TRANSFER_SETTLE_S` before answering
        its status: most land that fast, and a DONE now saves the caller a
        `transfer_poll`, which would wait behind the decode step the ranks run next."""
        if request_id in self.transfers:
            raise ValueError(f"request_id {request_id!r}: a transfer is already in flight")
        if instance not in self.peers:
            raise ValueError(f"instance {instance!r}: no handshake with it yet")
        mine = reads[self.spec.rank]
        if len(mine.scatter):
            check_copies(self.layout, mine.scatter, packed="src")
        peers = self.peers[instance]
        reader = None
        if stream is not None and stream.reader_rank == self.spec.rank:
            if len(stream.entries) != len(peers):
                raise ValueError(f"stream.entries: {len(stream.entries)} for {len(peers)} ranks")
            local = [entry_offset(self.layout, slot, r) for r in range(len(peers))]
            buffer = self.arena.buffer
            reader = ProgressReader(self.transport, peers, stream.entries, local, buffer,
                                    deadline_s)  # fmt: skip
        self.engine.mark_filling(slot, block_ids)
        now = time.monotonic()
        transfer = _Transfer(slot, now, mine.scatter, now + deadline_s, instance,
                             sealed=stream is None, reader=reader)  # fmt: skip
        self.transfers[request_id] = transfer
        try:
            self._post(transfer, peers, mine)
            if reader is not None:
                reader.advance()
        except Exception:
            self.transfer_end(request_id)
            raise
        nbytes = sum(int(batch.nbytes.sum()) for batch in mine.batches)
        settle_until = time.monotonic() + TRANSFER_SETTLE_S
        while transfer.sealed and nbytes <= SETTLE_MAX_BYTES:
            self._advance(transfer)
            if transfer.status.state is not TransferState.PENDING or (
                time.monotonic() >= settle_until
            ):
                break
            time.sleep(SETTLE_POLL_S)
        return transfer.status

    def transfer_post(self, request_id: str, reads: tuple[RankReads, ...], last: bool) -> None:
        """Post more READs of an open stream; `last` seals it."""
        transfer = self._transfer(request_id)
        if transfer.sealed:
            raise ValueError(f"request_id {request_id!r}: the transfer is not an open stream")
        peers = self.peers[transfer.instance]
        self._post(transfer, peers, reads[self.spec.rank])
        if last:
            transfer.sealed = True
            _stop_reader(transfer)

    def _post(self, transfer: _Transfer, peers: list[str], mine: RankReads) -> None:
        deadline_s = transfer.deadline_at - time.monotonic()
        if deadline_s <= 0 and mine.batches:
            raise ValueError("transfer: past its deadline, no READ may be posted")
        for reads_from in mine.batches:
            batch = RangeBatch(reads_from.local, reads_from.remote, reads_from.nbytes)
            peer = peers[reads_from.prefill_rank]
            handle = self.transport.post(Op.READ, peer, batch, deadline_s=deadline_s)
            transfer.handles.append(handle)

    def transfer_poll(self, request_id: str) -> RankTransferStatus:
        """Once DONE the slot is READY. A finished transfer keeps its status until
        `transfer_end`."""
        transfer = self._transfer(request_id)
        self._advance(transfer)
        return transfer.status

    def after_command(self) -> None:
        """Run by the command loop after every command: notice finished transfers early."""
        for transfer in self.transfers.values():
            self._advance(transfer)

    def _advance(self, transfer: _Transfer) -> None:
        if transfer.status.state is not TransferState.PENDING:
            return
        statuses = [self.transport.poll(handle) for handle in transfer.handles]
        reasons = [s.reason for s in statuses if s.failed]
        reader = transfer.reader
        if reader is not None:
            reader.advance()
            if reader.failure:
                reasons.append(reader.failure)
        if reasons:
            # Handles stay: a failed READ may still land (NIXL cannot cancel one in flight).
            _stop_reader(transfer)
            transfer.status = RankTransferStatus(TransferState.FAILED, reason="; ".join(reasons))
        elif not transfer.sealed:
            if reader is not None:
                transfer.status = RankTransferStatus(TransferState.PENDING, progress=reader.words)
        elif not any(s.pending for s in statuses):
            self._drop_handles(transfer)
            if len(transfer.scatter):
                scatter_from_staging(self.arena.buffer, self.layout, transfer.scatter)
            seconds = time.monotonic() - transfer.posted_at
            self.engine.mark_ready(transfer.slot)
            transfer.status = RankTransferStatus(TransferState.DONE, seconds)

    def transfer_end(self, request_id: str) -> bool:
        """Forget a transfer. True when none of its READs can still move bytes, so its slot
        and blocks may be reused; otherwise keep polling with `transfer_settled`. A slot
        whose transfer did not finish stays FILLING until `release`."""
        transfer = self.transfers.pop(request_id, None)
        if transfer is not None:
            _stop_reader(transfer)
        if transfer is not None and transfer.handles:
            self.unsettled[request_id] = list(transfer.handles)
            transfer.handles.clear()
        return self.transfer_settled(request_id)

    def transfer_settled(self, request_id: str) -> bool:
        """Release the request's READs that can no longer move bytes; True when none remain."""
        remaining = []
        for handle in self.unsettled.pop(request_id, []):
            status = self.transport.poll(handle)
            if status.pending or not status.settled:
                remaining.append(handle)
            else:
                with contextlib.suppress(ValueError):
                    self.transport.release(handle)
        if remaining:
            self.unsettled[request_id] = remaining
        return not remaining

    def _drop_handles(self, transfer: _Transfer) -> None:
        for handle in transfer.handles:
            with contextlib.suppress(ValueError):
                self.transport.release(handle)
        transfer.handles.clear()

    def decode_step(
        self,
        token: int | None,
        position: int,
        block_ids: list[int],
        slot: int,
        sampling: SamplingParams,
        index: int,
    ) -> TokenPick:
        token = self._fed_token(token, position, slot)
        sampler = _sampler(sampling)
        pick = self.engine.decode_step_pick(token, position, block_ids, slot, sampler, index)
        self.picked[slot] = (position + 1, pick.token)
        return TokenPick(pick.token, pick.logprob)

    def decode_batch(self, steps: Sequence[DecodeStep]) -> tuple[TokenPick, ...]:
        # Run in slot order: the states of consecutive slots are one slice of each cache,
        # read and written without a gather (transfer.model.layers.varlen).
        order = sorted(range(len(steps)), key=lambda i: steps[i].slot)
        ordered = [steps[i] for i in order]
        tokens = [self._fed_token(s.token, s.position, s.slot) for s in ordered]
        sequences = [
            SequenceStep.decode(t, s.slot, s.block_ids, s.position)
            for t, s in zip(tokens, ordered, strict=True)
        ]
        samplers = [_sampler(s.sampling) for s in ordered]
        output = self.batch.step(sequences, samplers, [s.index for s in ordered])
        picks: list[TokenPick | None] = [None] * len(steps)
        for i, s, p in zip(order, ordered, output.picks, strict=True):
            self.picked[s.slot] = (s.position + 1, p.token)
            picks[i] = TokenPick(p.token, p.logprob)
        return tuple(picks)

    def _fed_token(self, token: int | None, position: int, slot: int) -> int:
        if token is not None:
            return token
        picked = self.picked.get(slot)
        if picked is None or picked[0] != position:
            has = "none" if picked is None else f"one for position {picked[0]}"
            raise InvalidInput(
                f"token: none given, and slot {slot} has no pick for position {position} "
                f"from its last decode step (it has {has})"
            )
        return picked[1]

    def _transfer(self, request_id: str) -> _Transfer:
        try:
            return self.transfers[request_id]
        except KeyError:
            raise ValueError(f"request_id {request_id!r}: no transfer in flight") from None

    def close(self) -> None:
        for request_id in list(self.transfers):
            self.transfer_end(request_id)
        self.unsettled.clear()  # closing the transport ends whatever still moves
        self.transport.close()


def _stop_reader(transfer: _Transfer) -> None:
    """A stream's progress READs stop; any still in flight settle with the transfer's."""
    if transfer.reader is not None:
        transfer.handles.extend(transfer.reader.stop())
        transfer.reader = None


def _sampler(sampling: SamplingParams) -> Sampler:
    return Sampler(sampling.temperature, sampling.top_p, sampling.seed or 0)
