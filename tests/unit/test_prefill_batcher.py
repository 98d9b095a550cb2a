"""PrefillBatcher against a fake rank group: the token budget per step, chunking of long
prompts in order, cancellation between chunks, and errors that stay with their request."""

from __future__ import annotations

import threading
import time

import pytest

from transfer.errors import Cancelled, Closed, InvalidInput, PdxferError
from transfer.serving.engine.prefill_batcher import PrefillBatcher
from transfer.serving.ranks.commands import PrefillBatch, TokenPick

TIMEOUT_S = 10.0


class FakeRanks:
    """Records each step's (slot, context_len, num_tokens); picks 100 * slot + the number
    of tokens the slot has seen; fails any step holding `bad_slot`."""

    def __init__(self, step_s: float = 0.0, bad_slot: int | None = None) -> None:
        self.step_s = step_s
        self.bad_slot = bad_slot
        self.steps: list[tuple[tuple[int, int, int], ...]] = []
        self.lock = threading.Lock()

    def call(self, command: PrefillBatch) -> list[tuple[TokenPick, ...]]:
        assert isinstance(command, PrefillBatch)
        parts = tuple((c.slot, c.context_len, len(c.tokens)) for c in command.chunks)
        with self.lock:
            self.steps.append(parts)
        time.sleep(self.step_s)
        if any(slot == self.bad_slot for slot, _, _ in parts):
            raise InvalidInput(f"slot {self.bad_slot} is broken")  # a check: nothing ran
        return [tuple(TokenPick(100 * s + c + n, -1.0) for s, c, n in parts)]


@pytest.fixture
def make():
    made = []

    def _make(ranks: FakeRanks, budget: int) -> PrefillBatcher:
        batcher = PrefillBatcher(ranks, budget)
        made.append(batcher)
        return batcher

    yield _make
    for batcher in made:
        batcher.close()


def run_all(batcher: PrefillBatcher, lengths: dict[int, int], **kwargs) -> dict:
    out: dict = {}

    def one(slot: int, n: int) -> None:
        try:
            prompt = tuple(range(1, n + 1))
            out[slot] = batcher.run(f"r{slot}", prompt, (slot,), slot, **kwargs).token
        except PdxferError as exc:
            out[slot] = exc

    threads = [threading.Thread(target=one, args=item) for item in lengths.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
        assert not t.is_alive()
    return out


def test_a_long_prompt_runs_in_chunks_of_the_budget_in_order(make):
    ranks = FakeRanks()
    out = run_all(make(ranks, budget=64), {3: 150})
    assert out[3] == 300 + 150
    assert [step[0] for step in ranks.steps] == [(3, 0, 64), (3, 64, 64), (3, 128, 22)]


def test_a_chunk_short_of_the_prompt_end_stops_at_a_multiple_of_64(make):
    """Where the chunked scans and attention tiles restart as in one pass; a budget too
    small for that still makes progress."""
    ranks = FakeRanks()
    run_all(make(ranks, budget=100), {3: 150})
    assert [step[0] for step in ranks.steps] == [(3, 0, 64), (3, 64, 86)]
    ranks = FakeRanks()
    run_all(make(ranks, budget=40), {3: 100})
    assert [step[0] for step in ranks.steps] == [(3, 0, 40), (3, 40, 24), (3, 64, 36)]


def test_concurrent_prompts_share_steps_within_the_budget(make):
    ranks = FakeRanks(step_s=0.05)
    lengths = {0: 30, 1: 40, 2: 50, 3: 20}
    out = run_all(make(ranks, budget=100), lengths)
    assert out == {s: 100 * s + n for s, n in lengths.items()}
    assert all(sum(n for _, _, n in step) <= 100 for step in ranks.steps)
    assert any(len(step) > 1 for step in ranks.steps)
    for slot, n in lengths.items():  # each prompt's chunks are contiguous and complete
        parts = [(c, k) for step in ranks.steps for s, c, k in step if s == slot]
        assert parts[0][0] == 0 and sum(k for _, k in parts) == n
        assert all(a[0] + a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))


def test_a_cancelled_prompt_stops_at_the_next_chunk(make):
    ranks = FakeRanks(step_s=0.02)
    batcher = make(ranks, budget=8)
    cancel = threading.Event()
    out: dict = {}

    def run() -> None:
        try:
            batcher.run("long", tuple(range(1000)), (0,), 0, is_cancelled=cancel.is_set)
        except PdxferError as exc:
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while len(ranks.steps) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    cancel.set()
    thread.join(TIMEOUT_S)
    assert isinstance(out["error"], Cancelled)
    assert len(ranks.steps) < 1000 // 8  # it did not run to the end


def test_a_failing_prompt_gets_the_error_and_the_others_finish(make):
    ranks = FakeRanks(step_s=0.01, bad_slot=1)
    out = run_all(make(ranks, budget=1000), {0: 10, 1: 10, 2: 10})
    assert isinstance(out[1], PdxferError)
    assert out[0] == 10 and out[2] == 210


def test_bad_arguments_and_close(make):
    with pytest.raises(InvalidInput, match="max_num_batched_tokens"):
        PrefillBatcher(FakeRanks(), 0)
    batcher = make(FakeRanks(), budget=4)
    with pytest.raises(InvalidInput, match="prompt_ids"):
        batcher.run("empty", (), (0,), 0)
    batcher.close()
    with pytest.raises(Closed):
        batcher.run("late", (1, 2), (0,), 0)
