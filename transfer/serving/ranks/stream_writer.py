"""A prefill rank's side of layer-wise streaming: publish each streamed prompt's progress
(`transfer.serving.ranks.progress`) in this rank's arena as the step's layers finish."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from transfer.cache.layout import Layout
from transfer.model.layers.common import AfterLayer
from transfer.packer import StagingPolicy, TransferRequest, plan_transfer
from transfer.serving.ranks.progress import (
    ENTRY_BYTES,
    FLOOR,
    LOGPROB,
    PROGRESS,
    TOKEN,
    entry_offset,
    floor_word,
    progress_word,
    stream_groups,
    token_words,
)


@dataclass(frozen=True)
class StreamedChunk:
    """A chunk of a streamed prompt in this step: tokens `[context_len, chunk_end)`."""

    slot: int
    key: int
    context_len: int
    chunk_end: int
    block_ids: tuple[int, ...]
    ends_prompt: bool = False


class ProgressWriter:
    """Writes the progress words of streamed chunks into `buffer` (this rank's arena).

    `scribble_s` (tests only) makes this rank overwrite each group's fresh bytes with noise
    for that long, restoring them just before it publishes the group: a reader that reads a
    group before its readiness gets noise.
    """

    def __init__(self, buffer: torch.Tensor, layout: Layout, scribble_s: float = 0.0) -> None:
        self.buffer = buffer
        self.layout = layout
        self.groups = stream_groups(layout.geometry, layout.options.layer_group)
        self.group_ending = {members[-1]: g for g, members in enumerate(self.groups)}
        self.scribble_s = scribble_s

    def after_layer(self, chunks: Sequence[StreamedChunk]) -> AfterLayer | None:
        """The hook of a step that runs `chunks` (None when none is streamed)."""
        if not chunks:
            return None

        def publish(layer: int) -> None:
            group = self.group_ending.get(layer)
            if group is None:
                return
            for chunk in chunks:
                if self.scribble_s:
                    self._scribble(chunk, self.groups[group])
            self._settle()
            for chunk in chunks:
                entry = self._entry(chunk)
                if group == 0:
                    entry[FLOOR] = floor_word(chunk.key, chunk.context_len)
                entry[PROGRESS] = progress_word(chunk.key, chunk.chunk_end, group + 1, False)

        return publish

    def stepped(self, chunks: Sequence[StreamedChunk], picks: Sequence[tuple[int, float]]) -> None:
        """After the step: a prompt's first token (`picks[i]`, chunk i ends the prompt),
        then `picked`; then each chunk's floor at its end."""
        self._settle()
        for chunk, (token, logprob) in zip(chunks, picks, strict=True):
            entry = self._entry(chunk)
            if chunk.ends_prompt:
                entry[TOKEN], entry[LOGPROB] = token_words(chunk.key, token, logprob)
                groups = len(self.groups)
                entry[PROGRESS] = progress_word(chunk.key, chunk.chunk_end, groups, True)
            entry[FLOOR] = floor_word(chunk.key, chunk.chunk_end)
        self._settle()

    def _entry(self, chunk: StreamedChunk) -> torch.Tensor:
        """int64 [WORDS]: the chunk's slot's entry, a view into the arena."""
        at = entry_offset(self.layout, chunk.slot)
        return self.buffer[at : at + ENTRY_BYTES].view(torch.int64)

    def _settle(self) -> None:
        """Every write before this point is in memory a NIC reads (GPU: the stream ran)."""
        if self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)

    def _scribble(self, chunk: StreamedChunk, layers: tuple[int, ...]) -> None:
        ranges = self._part_ranges(chunk, layers)
        saved = [self.buffer[s : s + n].clone() for s, n in ranges]
        until = time.monotonic() + self.scribble_s
        while time.monotonic() < until:
            for s, n in ranges:
                self.buffer[s : s + n] = torch.randint(0, 256, (n,), dtype=torch.uint8)
            time.sleep(0.001)
        for (s, n), data in zip(ranges, saved, strict=True):
            self.buffer[s : s + n] = data

    def _part_ranges(self, chunk: StreamedChunk, layers: tuple[int, ...]) -> list[tuple[int, int]]:
        """(offset, bytes) of this rank's KV of the chunk's tokens and state of `layers`."""
        ranks = self.layout.all_ranks()
        request = TransferRequest(
            chunk.chunk_end, chunk.block_ids, (chunk.slot,), chunk.block_ids, (chunk.slot,)
        )
        plans = plan_transfer(
            ranks, ranks, request, StagingPolicy(enabled=False), layers=layers,
            tokens=(chunk.context_len, chunk.chunk_end),
        )  # fmt: skip
        mine = self.layout.rank
        return sorted(
            {
                (s, n)
                for plan in plans
                for source in plan.sources
                if source.prefill_rank == mine
                for s, _, n in source.wire.entries()
            }
        )
