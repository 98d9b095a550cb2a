"""What one TP rank process holds and does: its arena and model shard; its transfers go
through `RankTransfers` (transfer.serving.ranks.rank_transfers) and the shared `TransferAgent`.

Every public method backs a command of `transfer.serving.ranks.commands`, which the control
process runs on all ranks at once (`RankGroup.call`); each rank acts on its own shard and
answers for itself.

A transfer into this rank is asynchronous: `transfer_start` marks the slot and blocks
FILLING and posts the READs, later commands (decode steps of other requests) run while the
bytes land, and `transfer_poll` marks the slot READY only once every READ is DONE. A step
on a FILLING slot or block raises (docs/bugs.md, bug 6), and nothing on the decode side
ever starts a transferred slot from zeros (bug 4): only `prefill` does that.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

import torch

from transfer.agent import TransferAgent
from transfer.cache.arena import Arena
from transfer.cache.head_units import LayoutOptions
from transfer.cache.layout import Layout
from transfer.control.types import SamplingParams
from transfer.dataplane import make_transport
from transfer.errors import InvalidInput
from transfer.model.batch import SequenceStep
from transfer.model.batch_runner import BatchEngine
from transfer.model.caches import ArenaCaches
from transfer.model.loader import load_model
from transfer.model.runner import RankEngine
from transfer.model.sampling import Sampler
from transfer.serving.ranks.commands import (
    DecodeStep,
    PrefillChunk,
    RankInfo,
    RankTransferStatus,
    StreamSource,
    TokenPick,
)
from transfer.serving.ranks.cpu_rank import configure_cpu_rank
from transfer.serving.ranks.progress import progress_area_bytes
from transfer.serving.ranks.rank_transfers import RankTransfers
from transfer.serving.ranks.snapshots import save_snapshot, snapshot_request
from transfer.serving.ranks.spec import Copies, RankReads, RankSpec, staging_area_bytes
from transfer.serving.ranks.stream_writer import ProgressWriter, StreamedChunk

logger = logging.getLogger(__name__)


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
        agent = TransferAgent(make_transport(spec.transport, spec.agent_name))
        self.transfers = RankTransfers(agent, self.arena.buffer, self.layout, spec.rank,
                                       self.engine.mark_filling, self.engine.mark_ready)  # fmt: skip
        self.metadata = self.transfers.metadata
        scribble = spec.stream_scribble_s if spec.rank == spec.tp - 1 else 0.0
        self.progress = ProgressWriter(self.arena.buffer, self.layout, scribble)
        # slot -> (position, token): what its last decode step picked, for a pipelined
        # step that names no token (sent before that pick came back to the control side).
        self.picked: dict[int, tuple[int, int]] = {}

    # -- handshake ------------------------------------------------------------------------

    def info(self) -> RankInfo:
        return RankInfo(self.metadata, json.dumps(self.layout.to_dict()).encode())

    def add_peers(self, instance: str, metadata: list[bytes], staging: list[int]) -> None:
        self.transfers.add_peers(instance, metadata, staging)

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
        self.transfers.stage_gather(copies)

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
        return self.transfers.start(request_id, instance, reads, slot, block_ids, deadline_s,
                                    stream)  # fmt: skip

    def transfer_post(self, request_id: str, reads: tuple[RankReads, ...], last: bool) -> None:
        self.transfers.post(request_id, reads, last)

    def transfer_poll(self, request_id: str) -> RankTransferStatus:
        return self.transfers.poll(request_id)

    def bind_thread(self) -> None:
        """Run by a thread of the rank besides its command loop before any command."""
        if self.spec.device == "cuda":
            torch.cuda.set_device(self.spec.local_rank)

    def after_command(self) -> None:
        """Run by the command loop after every command: notice finished transfers early."""
        self.transfers.advance_all()

    def transfer_end(self, request_id: str) -> bool:
        return self.transfers.end(request_id)

    def transfer_settled(self, request_id: str) -> bool:
        return self.transfers.settled(request_id)

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

    def close(self) -> None:
        self.transfers.close()


def _sampler(sampling: SamplingParams) -> Sampler:
    return Sampler(sampling.temperature, sampling.top_p, sampling.seed or 0)
