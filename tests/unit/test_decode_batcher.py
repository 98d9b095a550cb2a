"""DecodeBatcher against a fake rank group: who shares a step, what each stream gets, and
that a request out of its stream is never stepped again."""

from __future__ import annotations

import threading
import time

import pytest

from transfer.errors import Closed, InvalidInput, PdxferError
from transfer.serving.commands import DecodeBatch, DecodeStep, TokenPick
from transfer.serving.decode_batcher import DecodeBatcher

TIMEOUT_S = 10.0


class FakeRanks:
    """Answers token = 1000 * slot + position; fails any batch holding `bad_slot`."""

    def __init__(self, step_s: float = 0.0, bad_slot: int | None = None) -> None:
        self.step_s = step_s
        self.bad_slot = bad_slot
        self.batches: list[tuple[int, ...]] = []  # slots of each step, in order
        self.lock = threading.Lock()

    def call(self, command: DecodeBatch) -> list[tuple[TokenPick, ...]]:
        assert isinstance(command, DecodeBatch)
        slots = tuple(s.slot for s in command.steps)
        with self.lock:
            self.batches.append(slots)
        time.sleep(self.step_s)
        if self.bad_slot in slots:
            raise InvalidInput(f"slot {self.bad_slot} is broken")  # a check: nothing ran
        return [tuple(TokenPick(1000 * s.slot + s.position, -0.5) for s in command.steps)]


def first(slot: int, position: int = 10) -> DecodeStep:
    return DecodeStep(7, position, (slot,), slot, index=1)


def collect(batcher: DecodeBatcher, slot: int, max_tokens: int, out: dict) -> None:
    try:
        out[slot] = [p.token for p in batcher.stream(f"r{slot}", first(slot), max_tokens)]
    except PdxferError as exc:
        out[slot] = exc


def run_streams(batcher: DecodeBatcher, lengths: dict[int, int]) -> dict:
    out: dict = {}
    threads = [
        threading.Thread(target=collect, args=(batcher, slot, n, out))
        for slot, n in lengths.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
        assert not t.is_alive()
    return out


@pytest.fixture
def make():
    made = []

    def _make(ranks: FakeRanks, max_num_seqs: int = 8) -> DecodeBatcher:
        batcher = DecodeBatcher(ranks, max_num_seqs)
        made.append(batcher)
        return batcher

    yield _make
    for batcher in made:
        batcher.close()


def test_each_stream_gets_its_own_tokens_and_requests_share_steps(make):
    ranks = FakeRanks(step_s=0.05)  # long enough for all three threads to join on a busy box
    lengths = {0: 4, 1: 9, 2: 6}
    out = run_streams(make(ranks), lengths)
    for slot, n in lengths.items():
        # token index i (1..n-1) is fed at position 10 + i - 1
        assert out[slot] == [1000 * slot + 10 + i for i in range(n - 1)]
    assert max(len(b) for b in ranks.batches) == 3  # all three ran in one step
    assert sum(len(b) for b in ranks.batches) == sum(n - 1 for n in lengths.values())


def test_max_num_seqs_caps_the_batch(make):
    ranks = FakeRanks(step_s=0.03)
    out = run_streams(make(ranks, max_num_seqs=2), {s: 5 for s in range(5)})
    assert all(len(out[s]) == 4 for s in range(5))
    assert max(len(b) for b in ranks.batches) <= 2
    assert any(len(b) == 2 for b in ranks.batches)


def test_a_failing_request_gets_the_error_and_the_others_go_on(make):
    ranks = FakeRanks(step_s=0.01, bad_slot=1)
    out = run_streams(make(ranks), {0: 6, 1: 6, 2: 6})
    assert isinstance(out[1], PdxferError) and "slot 1" in str(out[1])
    assert out[0] == [10 + i for i in range(5)]
    assert out[2] == [2010 + i for i in range(5)]
    stepped_after_failure = [b for b in ranks.batches if len(b) == 1 and b != (1,)]
    assert stepped_after_failure  # the batch was split to find the culprit
    assert ranks.batches[-1] != (1,)


def test_a_closed_stream_is_never_stepped_again(make):
    ranks = FakeRanks(step_s=0.005)
    batcher = make(ranks)
    others: dict = {}
    background = threading.Thread(target=collect, args=(batcher, 0, 40, others))
    background.start()
    stream = batcher.stream("r5", first(5), 1000)
    assert next(stream).token == 5010
    stream.close()
    with ranks.lock:
        seen = len(ranks.batches)
    background.join(TIMEOUT_S)
    assert len(others[0]) == 39
    assert all(5 not in b for b in ranks.batches[seen:])


def test_a_request_with_nothing_left_to_decode_never_joins(make):
    ranks = FakeRanks()
    assert list(make(ranks).stream("r0", first(0), 1)) == []
    assert ranks.batches == []


def test_close_ends_waiting_streams_with_closed(make):
    ranks = FakeRanks(step_s=0.05)
    batcher = make(ranks)
    out: dict = {}
    thread = threading.Thread(target=collect, args=(batcher, 3, 10_000, out))
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not ranks.batches:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    batcher.close()
    thread.join(TIMEOUT_S)
    assert isinstance(out[3], Closed)
    with pytest.raises(Closed):
        next(batcher.stream("late", first(4), 5))


def test_max_num_seqs_must_be_positive():
    with pytest.raises(InvalidInput, match="max_num_seqs"):
        DecodeBatcher(FakeRanks(), 0)


def test_ranks_that_disagree_fail_the_step(make):
    class Diverged(FakeRanks):
        def call(self, command):
            (picks,) = super().call(command)
            return [picks, tuple(TokenPick(p.token + 1, p.logprob) for p in picks)]

    out = run_streams(make(Diverged()), {0: 3})
    assert isinstance(out[0], PdxferError) and "disagree" in str(out[0])


def test_a_failure_after_the_step_ran_fails_the_whole_batch(make):
    """Only a failed check (nothing ran) is retried request by request; anything else may
    have advanced some states, so no request of that batch may go on."""

    class Broken(FakeRanks):
        def call(self, command):
            if len(command.steps) > 1:
                with self.lock:
                    self.batches.append(tuple(s.slot for s in command.steps))
                raise PdxferError("rank 0: device error mid-step")
            return super().call(command)

    ranks = Broken(step_s=0.05)
    out = run_streams(make(ranks), {0: 5, 1: 5})
    shared = [i for i, b in enumerate(ranks.batches) if len(b) > 1]
    assert shared, "the two requests never shared a step"
    assert all(isinstance(out[s], PdxferError) and "mid-step" in str(out[s]) for s in (0, 1))
    assert ranks.batches[shared[0] + 1 :] == []  # no retry one by one after such a failure
