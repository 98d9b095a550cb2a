"""Batched steps: one forward over several sequences, one all-reduce per sublayer for all.

`BatchEngine` runs over a `RankEngine`'s model, caches and slot table, so the per-request
methods and the transfer hooks (`mark_filling`, `mark_ready`, `release`) stay on that engine
and see the same slots. Every rank of a TP group must make the same calls with the same
sequences in the same order; every rank returns the same tokens (rank 0's, broadcast once
per step).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from transfer.errors import InvalidInput, PdxferError
from transfer.model.batch import SequenceStep, make_batch
from transfer.model.layers.common import AfterLayer
from transfer.model.runner import RankEngine, blocks_needed, is_index
from transfer.model.sampling import GREEDY, Pick, Sampler, choose_rows, logprobs_of


class StepFailed(PdxferError):
    """A step failed after its checks passed, once it may have written the caches: the
    linear-attention states of its sequences (advanced in place, layer by layer) may be
    half-advanced, so running any of them again would advance them twice. Deliberately of
    no error kind that says "changed nothing" (`InvalidInput`, `WrongState`)."""


@contextmanager
def _writing(num_sequences: int) -> Iterator[None]:
    """Raise any failure inside as `StepFailed`."""
    try:
        yield
    except StepFailed:
        raise
    except Exception as exc:
        raise StepFailed(
            f"a step of {num_sequences} sequences failed after its checks: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


@dataclass(frozen=True)
class StepOutput:
    """logits [B, vocab] fp32 of each sequence's last token, and the tokens picked from them
    (the same on every rank)."""

    logits: torch.Tensor
    picks: tuple[Pick, ...]

    @property
    def tokens(self) -> list[int]:
        return [p.token for p in self.picks]


class BatchEngine:
    """Steps of several sequences at once over `engine`'s model and caches.

    Slot lifecycle per sequence (docs/bugs.md #4, #6): a sequence with context_len 0 starts
    its FREE slot from zeros (it becomes READY); one with context_len > 0 continues a READY
    slot exactly as its bytes are (a later prompt chunk, a decode token, or the first decode
    token after a transfer). A slot or block being filled by a transfer raises
    `CacheFillingError`. A step that fails its checks changes nothing; one that fails
    after them raises `StepFailed`.
    """

    def __init__(self, engine: RankEngine) -> None:
        self.engine = engine

    def step_logits(
        self, sequences: Sequence[SequenceStep], after_layer: AfterLayer | None = None
    ) -> torch.Tensor:
        """Run one step; fp32 logits [B, vocab] of each sequence's last token, in order.
        `after_layer(i)` runs once the step has written layer i's caches."""
        sequences = self.check(sequences)
        slots = self.engine.slots
        for s in sequences:
            if s.context_len == 0:
                slots.begin_prefill(int(s.slot), s.block_ids)
        with _writing(len(sequences)):
            batch = make_batch(sequences, self.engine.caches, self.engine.device)
            return self.engine.model.forward_batch(batch, after_layer=after_layer)

    def step(
        self,
        sequences: Sequence[SequenceStep],
        samplers: Sequence[Sampler] | None = None,
        indices: Sequence[int] | None = None,
        after_layer: AfterLayer | None = None,
    ) -> StepOutput:
        """Run one step and pick each sequence's next token: greedy by default, else with
        `samplers[i]` as token `indices[i]` of sequence i's stream (`transfer.model.sampling`).
        A prompt chunk that is not the prompt's last gets a pick too; callers ignore it."""
        n = len(sequences)
        samplers = [GREEDY] * n if samplers is None else list(samplers)
        indices = [0] * n if indices is None else list(indices)
        if len(samplers) != n or len(indices) != n:
            raise InvalidInput(
                f"samplers, indices: need one per sequence ({n}), got "
                f"{len(samplers)} and {len(indices)}"
            )
        logits = self.step_logits(sequences, after_layer)
        with _writing(n):
            picked = choose_rows(logits, samplers, indices)
            tokens = torch.tensor(picked, dtype=torch.float64, device=logits.device)
            picks = torch.stack([tokens, logprobs_of(logits, picked).double()], dim=1)
            picks = self.engine.tp.broadcast_(picks.to(self.engine.device), src=0).cpu()
        return StepOutput(logits, tuple(Pick(int(t), float(lp)) for t, lp in picks.tolist()))

    def check(self, sequences: Sequence[SequenceStep]) -> tuple[SequenceStep, ...]:
        """Raise `InvalidInput` (naming `sequences[i].field`) or `CacheFillingError` unless
        every sequence may run in this step; changes nothing."""
        if isinstance(sequences, SequenceStep) or not isinstance(sequences, Sequence):
            raise InvalidInput("sequences: expected a sequence of SequenceStep")
        sequences = tuple(sequences)
        if not sequences:
            raise InvalidInput("sequences: a step needs at least one sequence")
        seen_slots: dict[int, int] = {}
        tables: dict[int, list[int]] = {}  # block -> the sequences whose table holds it
        for i, s in enumerate(sequences):
            field = f"sequences[{i}]"
            if not isinstance(s, SequenceStep):
                raise InvalidInput(f"{field}: expected a SequenceStep, got {type(s).__name__}")
            self._check_one(s, field)
            if s.slot in seen_slots:
                raise InvalidInput(
                    f"{field}.slot: {s.slot} is also sequences[{seen_slots[s.slot]}]'s"
                )
            seen_slots[s.slot] = i
            for b in set(s.block_ids):
                tables.setdefault(b, []).append(i)
        # Sequences may share blocks they only read (a cached prefix), never one that a
        # sequence of this step writes.
        block_size = self.engine.caches.block_size
        clashes = []  # (later sequence, earlier sequence, block)
        for i, s in enumerate(sequences):
            first = s.context_len // block_size
            end = -(-(s.context_len + len(s.tokens)) // block_size)
            for b in s.block_ids[first:end] if self.engine.has_kv else ():
                clashes += [(max(i, j), min(i, j), b) for j in tables[b] if j != i]
        if clashes:
            i, j, b = min(clashes)
            raise InvalidInput(
                f"sequences[{i}].block_ids: block {b} is also sequences[{j}]'s, and one of "
                "them writes it in this step (shared blocks must be read-only)"
            )
        slots = self.engine.slots
        for s in sequences:
            if s.context_len == 0:
                slots.check_prefill(int(s.slot), s.block_ids)
            else:
                slots.check_decode(int(s.slot), s.block_ids)
        return sequences

    def _check_one(self, s: SequenceStep, field: str) -> None:
        engine = self.engine
        vocab, num_slots = engine.geometry.vocab_size, engine.caches.num_slots
        if not s.tokens:
            raise InvalidInput(f"{field}.tokens: must not be empty")
        bad = [t for t in s.tokens if not is_index(t) or not 0 <= t < vocab]
        if bad:
            raise InvalidInput(
                f"{field}.tokens: token ids must be ints in [0, {vocab}), got {bad[:5]}"
            )
        if not is_index(s.context_len) or s.context_len < 0:
            raise InvalidInput(f"{field}.context_len: must be an int >= 0, got {s.context_len!r}")
        if not s.prefill and (len(s.tokens) != 1 or s.context_len < 1):
            raise InvalidInput(
                f"{field}: a decode step is one token after context_len >= 1 cached tokens, got "
                f"{len(s.tokens)} tokens after {s.context_len}"
            )
        if not is_index(s.slot) or not 0 <= s.slot < num_slots:
            raise InvalidInput(f"{field}.slot: must be an int in [0, {num_slots}), got {s.slot!r}")
        num_blocks = engine.caches.num_blocks
        bad = [b for b in s.block_ids if not is_index(b) or not 0 <= b < num_blocks]
        if bad:
            raise InvalidInput(
                f"{field}.block_ids: block ids must be ints in [0, {num_blocks}), got {bad[:5]}"
            )
        if len(set(s.block_ids)) != len(s.block_ids):
            raise InvalidInput(f"{field}.block_ids: must be distinct, got {list(s.block_ids)}")
        tokens = s.context_len + len(s.tokens)
        need = blocks_needed(tokens, engine.caches.block_size) if engine.has_kv else 0
        if len(s.block_ids) < need:
            raise InvalidInput(
                f"{field}.block_ids: {tokens} tokens need {need} blocks of "
                f"{engine.caches.block_size}, got {len(s.block_ids)}"
            )
