"""DecodeBatcher against a fake rank group: who shares a step, what each stream gets, and
that a request out of its stream is never stepped again."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from transfer.errors import Closed, InvalidInput, PdxferError
from transfer.serving.engine.decode_batcher import PIPELINE_DEPTH, DecodeBatcher
from transfer.serving.ranks.commands import DecodeBatch, DecodeStep, TokenPick

TIMEOUT_S = 10.0


class _Answer:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value = self.error = None

    def result(self, timeout_s: float = TIMEOUT_S):
        assert self.done.wait(timeout_s), "the fake rank never answered"
        if self.error is not None:
            raise self.error
        return self.value


class FakeRanks:
    """Runs commands in order on a thread of its own, `step_s` each, as rank 0 does.

    A step picks token 1000 * slot + position. A step that names no token feeds the slot's
    previous pick, which must be for its position, else the batch fails its checks (as
    `RankWorker` does). Fails the checks of any batch holding `bad_slot`, or all of
    `clash`."""

    def __init__(
        self, step_s: float = 0.0, bad_slot: int | None = None, clash: tuple[int, ...] = ()
    ) -> None:
        self.step_s = step_s
        self.bad_slot = bad_slot
        self.clash = set(clash)  # slots that fail the checks of any step holding them all
        self.batches: list[tuple[int, ...]] = []  # slots of each step, in order
        self.fed: dict[int, list[tuple[int, int]]] = {}  # slot -> (position, token) fed
        self.most_at_once = 0  # commands sent and not yet answered, at most
        self.lock = threading.Lock()
        self._picked: dict[int, tuple[int, int]] = {}
        self._unanswered = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True).start()

    def submit(self, command: DecodeBatch) -> _Answer:
        answer = _Answer()
        with self.lock:
            self._unanswered += 1
            self.most_at_once = max(self.most_at_once, self._unanswered)
        self._queue.put((command, answer))
        return answer

    def _serve(self) -> None:
        while True:
            command, answer = self._queue.get()
            try:
                answer.value = self.apply(command)
            except Exception as exc:  # noqa: BLE001 - handed to the waiter
                answer.error = exc
            with self.lock:
                self._unanswered -= 1
            answer.done.set()

    def apply(self, command: DecodeBatch) -> list[tuple[TokenPick, ...]]:
        assert isinstance(command, DecodeBatch)
        slots = tuple(s.slot for s in command.steps)
        with self.lock:
            self.batches.append(slots)
        time.sleep(self.step_s)
        if self.bad_slot in slots:
            raise InvalidInput(f"slot {self.bad_slot} is broken")  # a check: nothing ran
        if self.clash and self.clash <= set(slots):
            raise InvalidInput(f"slots {sorted(self.clash)} may not share a step")
        fed = []
        for s in command.steps:
            picked = self._picked.get(s.slot)
            if s.token is None and (picked is None or picked[0] != s.position):
                raise InvalidInput(f"token: slot {s.slot} picked none for {s.position}")
            fed.append(picked[1] if s.token is None else s.token)
        picks = tuple(TokenPick(1000 * s.slot + s.position, -0.5) for s in command.steps)
        for s, token, pick in zip(command.steps, fed, picks, strict=True):
            self.fed.setdefault(s.slot, []).append((s.position, token))
            self._picked[s.slot] = (s.position + 1, pick.token)
        return [picks]


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


def test_steps_are_pipelined_and_each_feeds_the_previous_pick(make):
    ranks = FakeRanks(step_s=0.02)
    lengths = {0: 12, 3: 7}
    out = run_streams(make(ranks), lengths)
    assert ranks.most_at_once == PIPELINE_DEPTH  # the next step waited at the rank
    for slot, n in lengths.items():
        assert out[slot] == [1000 * slot + 10 + i for i in range(n - 1)]
        # position 10 feeds the prefill token (7), every later one the pick before it
        expected = [(10, 7)] + [(10 + i, 1000 * slot + 10 + i - 1) for i in range(1, n - 1)]
        assert ranks.fed[slot] == expected


def test_a_request_is_never_sent_past_its_last_token(make):
    ranks = FakeRanks(step_s=0.01)
    run_streams(make(ranks), {0: 3, 1: 9})
    assert [b.count(0) for b in ranks.batches].count(1) == 2  # tokens 1 and 2 only


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


def test_a_step_behind_a_failed_one_does_not_fail_its_requests(make):
    """Two requests that may not share a step: each shared step fails its checks, and the
    step already sent behind it fails for want of the picks it never made, even when it
    holds only one of them. Neither request gets an error; each is stepped alone."""
    ranks = FakeRanks(step_s=0.05, clash=(0, 1))  # both join before the first step ends
    out = run_streams(make(ranks), {0: 4, 1: 8})
    assert out[0] == [10 + i for i in range(3)]
    assert out[1] == [1010 + i for i in range(7)]
    assert any(sorted(b) == [0, 1] for b in ranks.batches), ranks.batches  # they tried


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
        def apply(self, command):
            (picks,) = super().apply(command)
            return [picks, tuple(TokenPick(p.token + 1, p.logprob) for p in picks)]

    out = run_streams(make(Diverged()), {0: 3})
    assert isinstance(out[0], PdxferError) and "disagree" in str(out[0])


def test_a_failure_after_the_step_ran_fails_the_whole_batch(make):
    """Only a failed check (nothing ran) is retried request by request; anything else may
    have advanced some states, so no request of that batch may go on."""

    class Broken(FakeRanks):
        def apply(self, command):
            if len(command.steps) > 1:
                with self.lock:
                    self.batches.append(tuple(s.slot for s in command.steps))
                raise PdxferError("rank 0: device error mid-step")
            return super().apply(command)

    ranks = Broken(step_s=0.05)
    out = run_streams(make(ranks), {0: 5, 1: 5})
    shared = [i for i, b in enumerate(ranks.batches) if len(b) > 1]
    assert shared, "the two requests never shared a step"
    assert all(isinstance(out[s], PdxferError) and "mid-step" in str(out[s]) for s in (0, 1))
    # no retry one by one after such a failure; the step sent behind it fails too
    after = ranks.batches[shared[0] :]
    assert len(after) <= PIPELINE_DEPTH and all(len(b) > 1 for b in after)
