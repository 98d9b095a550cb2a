"""One forward step over several sequences: what the model's layers read.

Each sequence of a step is a prefill chunk (any number of tokens; it starts from zeros when
nothing of it is cached yet, else it continues from its slot's state and its earlier KV) or
one decode token. Their tokens are packed in order along T and bounded by `cu_seqlens`;
every projection, MLP and all-reduce runs once over all T tokens. Why prefill and decode
share a step: docs/workers.md, "Batched steps".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from transfer.model.caches import CacheAccess
from transfer.model.layers.common import Step


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's part of a step.

    tokens: its new tokens; slot: its S&Conv slot; block_ids: its block table, covering
    context_len + len(tokens) tokens; context_len: its tokens already cached (0 for the
    first chunk of a prompt); prefill: a prompt chunk, run with the chunked kernels, rather
    than one decode token, run with the recurrent kernels.
    """

    tokens: tuple[int, ...]
    slot: int
    block_ids: tuple[int, ...]
    context_len: int = 0
    prefill: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(self.tokens))
        object.__setattr__(self, "block_ids", tuple(self.block_ids))

    @classmethod
    def decode(
        cls, token: int, slot: int, block_ids: Sequence[int], context_len: int
    ) -> SequenceStep:
        """Feed `token` after the `context_len` tokens the slot and blocks already hold."""
        return cls((token,), slot, tuple(block_ids), context_len, prefill=False)


@dataclass(frozen=True)
class Part:
    """The sequences of a batch that share one kind of kernel: chunked (prefill chunks) or
    recurrent (decode tokens).

    tokens [Tg] int64: their tokens' indices along the batch's T, in order;
    cu_seqlens [Ng+1] int64: their bounds within those Tg tokens; slots [Ng] int64;
    fresh [Ng] bool: no context yet, so the state starts from zeros (never read from the
    slot); num_fresh: how many are fresh; span: the same tokens as a slice when they are one
    run (always so in a step of one kind), which reads a view and writes without an index;
    slot_runs: (first sequence, first slot, count) of each run of sequences whose slots
    follow one another, in order, so that their states are one slice of a cache, read and
    written without an index.
    """

    chunked: bool
    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    slots: torch.Tensor
    fresh: torch.Tensor
    num_fresh: int
    span: slice | None = None
    slot_runs: tuple[tuple[int, int, int], ...] = ()

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] -> this part's rows [Tg, ...] (a view when the part is one run)."""
        return x[self.tokens] if self.span is None else x[self.span]

    def put(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        """Write rows [Tg, ...] to this part's rows of out [T, ...]."""
        if self.span is None:
            out[self.tokens] = rows
        else:
            out[self.span] = rows


@dataclass(frozen=True)
class Batch:
    """B sequences' tokens of one step, packed along T, and the caches they read and write.

    token_ids, positions [T] int64 (a token's position is its sequence's context_len plus
    its index in the chunk); cu_seqlens [B+1] int64; slots, context_lens [B] int64;
    block_tables [B, max_blocks] int64, padded with -1 (never read); last_tokens [B] int64:
    each sequence's last token along T; token_blocks, token_offsets [T] int64: the block
    and row each token's KV goes to (empty without caches). `sequences` and `bounds` (the
    host cu_seqlens) are what the layers loop over; `prefill` and `decode` are the two
    kernel parts (None when empty). With `caches` None every sequence is a fresh prefill
    and nothing is read or written: the cache-free full-sequence forward.
    """

    sequences: tuple[SequenceStep, ...]
    bounds: tuple[int, ...]
    token_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    slots: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    last_tokens: torch.Tensor
    token_blocks: torch.Tensor
    token_offsets: torch.Tensor
    prefill: Part | None
    decode: Part | None
    caches: CacheAccess | None

    @property
    def num_sequences(self) -> int:
        return len(self.sequences)

    def span(self, i: int) -> slice:
        """Sequence i's tokens along T."""
        return slice(self.bounds[i], self.bounds[i + 1])

    @classmethod
    def from_step(cls, step: Step, token_ids: torch.Tensor) -> Batch:
        """The one-sequence batch of a per-request `Step` over `token_ids` [T]."""
        context = 0 if step.prefill else int(step.positions[0])
        sequence = SequenceStep(
            tuple(token_ids.tolist()), step.slot, tuple(step.block_ids.tolist()), context,
            prefill=step.prefill,
        )  # fmt: skip
        return make_batch([sequence], step.caches, token_ids.device)


def make_batch(
    sequences: Sequence[SequenceStep],
    caches: CacheAccess | None,
    device: torch.device | str = "cpu",
) -> Batch:
    """Pack `sequences` (already checked: see `transfer.model.batch_runner`) into a Batch."""
    device = torch.device(device)
    sequences = tuple(sequences)
    lengths = [len(s.tokens) for s in sequences]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)

    def longs(values) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=device)

    lens, context = longs(lengths), longs(s.context_len for s in sequences)
    seq_of_token = torch.repeat_interleave(torch.arange(len(sequences), device=device), lens)
    starts = longs(bounds[:-1])
    positions = (
        context[seq_of_token] + torch.arange(bounds[-1], device=device) - starts[seq_of_token]
    )
    width = max(len(s.block_ids) for s in sequences)
    padded_tables = [[*s.block_ids, *[-1] * (width - len(s.block_ids))] for s in sequences]
    tables = torch.tensor(padded_tables, dtype=torch.long, device=device)
    if caches is None or width == 0:
        token_blocks = token_offsets = longs(())
    else:
        token_blocks = tables[seq_of_token, positions // caches.block_size]
        token_offsets = positions % caches.block_size
    slots = longs(s.slot for s in sequences)
    parts = {chunked: _part(sequences, bounds, slots, chunked, device) for chunked in (True, False)}
    return Batch(
        sequences=sequences,
        bounds=tuple(bounds),
        token_ids=longs(t for s in sequences for t in s.tokens),
        positions=positions,
        cu_seqlens=longs(bounds),
        slots=slots,
        context_lens=context,
        block_tables=tables,
        last_tokens=longs(bounds[1:]) - 1,
        token_blocks=token_blocks,
        token_offsets=token_offsets,
        prefill=parts[True],
        decode=parts[False],
        caches=caches,
    )


def _part(sequences, bounds, slots, chunked: bool, device) -> Part | None:
    members = [i for i, s in enumerate(sequences) if s.prefill == chunked]
    if not members:
        return None
    tokens, cu = [], [0]
    for i in members:
        tokens.extend(range(bounds[i], bounds[i + 1]))
        cu.append(len(tokens))
    fresh = [sequences[i].context_len == 0 for i in members]
    member_slots = [sequences[i].slot for i in members]
    index = torch.tensor(members, dtype=torch.long, device=device)
    first, end = bounds[members[0]], bounds[members[-1] + 1]
    one_run = end - first == len(tokens)
    return Part(
        chunked=chunked,
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        cu_seqlens=torch.tensor(cu, dtype=torch.long, device=device),
        slots=slots[index],
        fresh=torch.tensor(fresh, dtype=torch.bool, device=device),
        num_fresh=sum(fresh),
        span=slice(first, end) if one_run else None,
        slot_runs=_runs(member_slots),
    )


def _runs(slots: list[int]) -> tuple[tuple[int, int, int], ...]:
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, slot, 1))
    return tuple(runs)
