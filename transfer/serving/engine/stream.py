"""The decode control side of a layer-wise stream: from the prefill ranks' progress words
(`transfer.serving.ranks.progress`) to the READs of the parts that just became final.

Per group it remembers how far its KV has been read and whether its state has; each
`advance` plans only what is final on every prefill rank and not read yet, so every byte
is read once and never before it is final. Adjacent groups with the same new tokens are
planned together, so the packer coalesces across them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transfer.cache.layout import Layout
from transfer.errors import InvalidInput
from transfer.packer import StagingPolicy, TransferRequest, plan_transfer
from transfer.serving.engine.reads import reads_of
from transfer.serving.ranks.progress import (
    MAX_SOURCES,
    WORDS,
    Progress,
    entry_offset,
    least,
    read_entry,
    stream_groups,
)
from transfer.serving.ranks.spec import RankReads


@dataclass(frozen=True)
class StreamPart:
    """The KV of `tokens` of `layers`, with their state when `with_state`."""

    layers: tuple[int, ...]
    tokens: tuple[int, int]
    with_state: bool


def progress_entries(prefill: Sequence[Layout], slot: int) -> tuple[int, ...]:
    """The arena offset of `slot`'s progress entry on each prefill rank."""
    if len(prefill) > MAX_SOURCES:
        raise InvalidInput(f"layer-wise streaming reads at most {MAX_SOURCES} prefill ranks")
    return tuple(entry_offset(layout, slot) for layout in prefill)


class StreamPlanner:
    """Plans a streamed request's READs as its prefill finishes parts of it.

    `reused_tokens`: KV decode already holds (never read). `whole`: plan nothing until the
    prefill has finished, then everything at once (`--transfer-mode whole` on decode).
    """

    def __init__(
        self,
        prefill: Sequence[Layout],
        decode: Sequence[Layout],
        request: TransferRequest,
        key: int,
        *,
        reused_tokens: int = 0,
        whole: bool = False,
    ) -> None:
        self.prefill, self.decode = tuple(prefill), tuple(decode)
        self.request, self.key, self.whole = request, key, whole
        self.groups = stream_groups(prefill[0].geometry, prefill[0].options.layer_group)
        self.read_to = [reused_tokens] * len(self.groups)
        self.state_read = [False] * len(self.groups)
        self.finished = False  # every prefill rank has finished the prompt
        self.first_pick: tuple[int, float] | None = None
        self.kv_bytes = self.state_bytes = self.descriptors = 0

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens

    @property
    def complete(self) -> bool:
        """Every byte is planned and the first token is known."""
        done = all(self.state_read) and all(t == self.num_tokens for t in self.read_to)
        return done and self.first_pick is not None

    def _progress(self, words: Sequence[int]) -> list[Progress]:
        return [read_entry(words[r * WORDS : (r + 1) * WORDS], self.key)
                for r in range(len(self.prefill))]  # fmt: skip

    def advance(self, words: Sequence[int]) -> tuple[RankReads, ...] | None:
        """Per decode rank, the READs of what became final since the last call (None:
        nothing new). `words`: the progress entries, one per prefill rank, as read."""
        if len(words) < WORDS * len(self.prefill):
            return None  # the reader has no round yet
        progress = self._progress(words)
        self.finished = self.finished or all(p.finished(self.num_tokens) for p in progress)
        if self.first_pick is None and progress[0].first is not None:
            self.first_pick = progress[0].first
        if self.whole and not self.finished:
            return None
        finals, states = least(progress, len(self.groups), self.num_tokens)
        parts = self._new_parts(finals, states)
        return self._plan(parts) if parts else None

    def _new_parts(self, finals: Sequence[int], states: int) -> list[StreamPart]:
        parts: list[StreamPart] = []
        for g, members in enumerate(self.groups):
            start, end = self.read_to[g], max(self.read_to[g], finals[g])
            with_state = g < states and not self.state_read[g]
            if end == start and not with_state:
                continue
            self.read_to[g], self.state_read[g] = end, self.state_read[g] or with_state
            last = parts[-1] if parts else None
            if last is not None and last.tokens == (start, end) and last.with_state == with_state:
                parts[-1] = StreamPart(last.layers + members, (start, end), with_state)
            else:
                parts.append(StreamPart(members, (start, end), with_state))
        return parts

    def _plan(self, parts: Sequence[StreamPart]) -> tuple[RankReads, ...]:
        policy = StagingPolicy(enabled=False)
        per_rank: list[list] = [[] for _ in self.decode]
        for part in parts:
            plans = plan_transfer(
                self.prefill, self.decode, self.request, policy, layers=part.layers,
                tokens=part.tokens, with_state=part.with_state,
            )  # fmt: skip
            reads = reads_of(plans)
            for mine, rank_reads in zip(per_rank, reads.per_rank, strict=True):
                mine.extend(rank_reads.batches)
            self.kv_bytes += reads.kv_bytes
            self.state_bytes += reads.state_bytes
            self.descriptors += reads.descriptors
        return tuple(RankReads(tuple(batches)) for batches in per_rank)
