"""The decode engine on a real prefill/decode pair (tiny model, ranks in real processes):
who shares a decode step, counted by the engine's own step counters, never by the clock."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tests.support.worker_sides import one_thread, prompt, running_pair  # noqa: F401
from transfer.control.client import DecodeClient
from transfer.control.errors import ControlError
from transfer.control.types import DecodeRequest, PrefillRequest
from transfer.model.reference import reference_generate
from transfer.presets import get_preset
from transfer.serving.engine.request import DecodePhase
from transfer.serving.engine.step import StepPlan
from transfer.serving.engine.step_pipeline import StepPipeline
from transfer.serving.ranks.commands import DecodeBatch, Release, TransferPoll, TransferStart

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-next"
MAX_TOKENS = 9
TIMEOUT_S = 30.0
NAMES = ("a", "b", "c")


@pytest.fixture(scope="module")
def pair():
    with running_pair(MODEL, "engine", max_seqs=4) as sides:
        yield sides


def start_together(engine, names) -> None:
    """Let the named requests start decoding in one engine job, so one step sees them all."""

    def ready() -> None:
        for request in engine.active:
            if request.request_id in names:
                request.consumer_ready = True

    engine.call_soon(ready)


def wait_slots_free(decode, timeout_s: float = 30.0) -> None:
    """A finished request's slot goes back a step or two after its last token."""
    slots = decode.instance.pools.slots
    deadline = time.monotonic() + timeout_s
    while slots.num_free != slots.num_total:
        assert time.monotonic() < deadline, f"decode slots not all free within {timeout_s} s"
        time.sleep(0.05)


def per_decode_threads() -> list[str]:
    """DecodeMany's old path ran a thread per decode stream ("decode-many-<stream id>")."""
    names = (t.name for t in threading.enumerate())
    return [n for n in names if n.startswith("decode-many-") and n != "decode-many-reader"]


def test_running_requests_share_every_decode_step(pair):
    prefill, decode = pair
    engine, geometry = decode.worker.engine, get_preset(MODEL)
    ids = {name: prompt(40 + i) for i, name in enumerate(NAMES)}
    streams = {
        name: iter(decode.worker.decode(DecodeRequest(
            prefill.worker.prefill(PrefillRequest(name, tuple(p), MAX_TOKENS)), MAX_TOKENS)))
        for name, p in ids.items()
    }  # fmt: skip
    firsts = {name: next(stream).token for name, stream in streams.items()}
    # token 0 is the transfer's: no step ran for a request whose consumer did not ask on
    before = engine.decode_steps
    running = [r for r in engine.active if r.request_id in NAMES]
    assert {r.phase for r in running} == {DecodePhase.RUNNING}
    assert all(r.scheduled == 0 for r in running)
    start_together(engine, set(NAMES))
    tokens = {name: [firsts[name]] + [e.token for e in s] for name, s in streams.items()}
    for name in NAMES:
        assert tokens[name] == reference_generate(geometry, ids[name], MAX_TOKENS), name
    # Together from their first step to their last: one decode step per token after token 0.
    assert engine.decode_steps - before == MAX_TOKENS - 1
    wait_slots_free(decode)


def test_decode_many_streams_come_from_the_engine_a_step_at_a_time(pair):
    """Over DecodeMany the engine hands a step's events over itself (no thread per decode);
    each stream still gets exactly its own tokens, and an unknown prefill ends only its own."""
    prefill, decode = pair
    geometry = get_preset(MODEL)
    ids = {f"many-{i}": prompt(60 + i) for i in range(3)}
    tickets = {
        name: prefill.worker.prefill(PrefillRequest(name, tuple(p), MAX_TOKENS))
        for name, p in ids.items()
    }
    client = DecodeClient(decode.address, timeout_s=60.0)
    try:
        streams = {n: client.decode(DecodeRequest(t, MAX_TOKENS)) for n, t in tickets.items()}
        bad = replace(tickets["many-0"], request_id="stray", address="127.0.0.1:1")
        with pytest.raises(ControlError) as refused:
            list(client.decode(DecodeRequest(bad, MAX_TOKENS)))
        assert refused.value.code == "PERMISSION_DENIED"
        for name, stream in streams.items():
            events = list(stream)
            assert not per_decode_threads()  # the other streams are still open here
            assert [e.index for e in events] == list(range(MAX_TOKENS)) and events[-1].finished
            tokens = [e.token for e in events]
            assert tokens == reference_generate(geometry, ids[name], MAX_TOKENS), name
    finally:
        client.close()
    wait_slots_free(decode)


def record_steps(monkeypatch, decode) -> list[SimpleNamespace]:
    """Every step the decode engine sends: the sending thread's name (`thread`), its
    `commands` and whether it `overtakes`."""
    ranks, steps = decode.instance.ranks, []
    submit = ranks.submit

    def recording(command):
        steps.append(SimpleNamespace(thread=threading.current_thread().name,
                                     commands=getattr(command, "commands", (command,)),
                                     overtakes=getattr(command, "overtakes", False)))  # fmt: skip
        return submit(command)

    monkeypatch.setattr(ranks, "submit", recording)
    return steps


def carries(commands: tuple, kind: type, rid: str | None = None) -> bool:
    if kind is DecodeBatch:
        return any(isinstance(c, DecodeBatch) for c in commands)
    return any(isinstance(c, kind) and c.request_id == rid for c in commands)


def test_a_new_transfer_overtakes_the_decode_steps_and_only_the_loop_sends(pair, monkeypatch):
    """Issue 33: a new request's TransferStart goes at once, in a step of its own that runs
    before the decode step waiting at the ranks, and no decode batch is held back for it.
    Collector threads wait for the answers; the engine loop alone sends rank commands."""
    prefill, decode = pair
    engine, geometry = decode.worker.engine, get_preset(MODEL)
    long_tokens = 40  # decoding all the while the second request's transfer starts
    ids = {"long": prompt(80), "new": prompt(81)}
    tickets = {name: prefill.worker.prefill(PrefillRequest(name, tuple(p), long_tokens))
               for name, p in ids.items()}  # fmt: skip
    steps = record_steps(monkeypatch, decode)
    held_before = engine.held_back
    running = iter(decode.worker.decode(DecodeRequest(tickets["long"], long_tokens)))
    tokens = {"long": [next(running).token, next(running).token]}  # it is decoding now
    new = iter(decode.worker.decode(DecodeRequest(tickets["new"], MAX_TOKENS)))
    tokens["new"] = [e.token for e in new]
    tokens["long"] += [e.token for e in running]
    assert tokens["long"] == reference_generate(geometry, ids["long"], long_tokens)
    assert tokens["new"] == reference_generate(geometry, ids["new"], MAX_TOKENS)
    assert {step.thread for step in steps} == {"decode-engine"}
    (start,) = [i for i, step in enumerate(steps) if carries(step.commands, TransferStart, "new")]
    batches = [i for i, step in enumerate(steps) if carries(step.commands, DecodeBatch)]
    assert batches[0] < start < batches[-1], "the long request was not decoding then"
    assert steps[start].overtakes
    assert all(isinstance(c, TransferStart | TransferPoll) for c in steps[start].commands)
    assert engine.held_back == held_before
    wait_slots_free(decode)


def test_a_start_does_not_overtake_the_step_releasing_what_it_reuses(pair, monkeypatch):
    """A request's blocks and slot are back in the pools before its Release runs at the
    ranks: while that step is unanswered, a new request that reuses its slot starts in
    order, behind it. The Release step's answer is held here until the start was sent."""
    prefill, decode = pair
    geometry, ranks = get_preset(MODEL), decode.instance.ranks
    submit, steps, answer_releases = ranks.submit, [], threading.Event()

    def gated(command):
        pending, commands = submit(command), getattr(command, "commands", ())
        steps.append(SimpleNamespace(commands=commands, overtakes=command.overtakes))
        if not any(isinstance(c, Release) for c in commands):
            return pending

        def result(timeout_s: float):
            assert answer_releases.wait(timeout_s), "the test never let a Release answer"
            return pending.result(timeout_s)

        return SimpleNamespace(result=result)

    def sent_start(rid: str):
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            for step in list(steps):
                if carries(step.commands, TransferStart, rid):
                    return step
            assert time.monotonic() < deadline, f"{rid}'s start was never sent"
            time.sleep(0.01)

    ids = {"freed": prompt(90), "reuses": prompt(91)}
    tickets = {name: prefill.worker.prefill(PrefillRequest(name, tuple(p), MAX_TOKENS))
               for name, p in ids.items()}  # fmt: skip
    monkeypatch.setattr(ranks, "submit", gated)
    try:
        list(decode.worker.decode(DecodeRequest(tickets["freed"], MAX_TOKENS)))
        (freed,) = [s for s in steps if carries(s.commands, TransferStart, "freed")]
        released = [c.slot for s in steps for c in s.commands if isinstance(c, Release)]
        assert freed.commands[0].slot in released
        tokens: list[int] = []
        second = threading.Thread(target=lambda: tokens.extend(
            e.token for e in decode.worker.decode(DecodeRequest(tickets["reuses"], MAX_TOKENS))))  # fmt: skip
        second.start()
        start = sent_start("reuses")
        assert start.commands[0].slot == freed.commands[0].slot  # the lowest free one
        assert not start.overtakes
    finally:
        answer_releases.set()
    second.join(TIMEOUT_S)
    assert tokens == reference_generate(geometry, ids["reuses"], MAX_TOKENS)
    wait_slots_free(decode)


def test_only_the_thread_that_sent_first_may_send():
    """The single-sender rule, enforced: a rank command from another thread is a bug."""

    class Ranks:
        def submit(self, command):
            return SimpleNamespace(result=lambda timeout_s: [()])

    pipeline = StepPipeline(Ranks(), lambda: None, TIMEOUT_S)
    try:
        assert pipeline.send(StepPlan(0))
        failure: list[BaseException] = []

        def other() -> None:
            try:
                pipeline.send(StepPlan(1))
            except RuntimeError as exc:
                failure.append(exc)

        thread = threading.Thread(target=other, name="not-the-engine")
        thread.start()
        thread.join(TIMEOUT_S)
        assert failure and "not-the-engine sent a rank command" in str(failure[0])
    finally:
        pipeline.drain()
    assert len(pipeline) == 0


def test_an_overtaking_steps_answer_is_not_held_behind_the_step_it_overtook():
    """Each lane has its own collector: the answer of a step that overtook is handled as
    soon as it is in, while the in-order step sent before it still runs."""

    class Ranks:
        def __init__(self) -> None:
            self.answer_now: list[threading.Event] = []  # per step sent

        def submit(self, command):
            gate = threading.Event()
            self.answer_now.append(gate)

            def result(timeout_s: float):
                assert gate.wait(timeout_s), "the test never let this step answer"
                return [tuple(None for _ in command.commands)]

            return SimpleNamespace(result=result)

    def handle_until(count: int) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while len(handled) < count:
            assert time.monotonic() < deadline, f"only {handled} handled"
            woke.wait(0.1)
            woke.clear()
            pipeline.handle_answered()

    ranks, woke, handled = Ranks(), threading.Event(), []
    pipeline = StepPipeline(ranks, woke.set, TIMEOUT_S)
    try:
        in_order, overtaking = StepPlan(0), StepPlan(1, overtakes=True)
        in_order.add(TransferPoll("a"), lambda answer: handled.append("in order"))
        overtaking.add(TransferPoll("b"), lambda answer: handled.append("overtaking"))
        assert pipeline.send(in_order) and pipeline.send(overtaking)
        assert len(pipeline) == 1  # the pipeline's depth counts in-order steps only
        ranks.answer_now[1].set()  # rank 0 ran the overtaking step first
        handle_until(1)
        assert handled == ["overtaking"] and not pipeline.answered_through(0)
        ranks.answer_now[0].set()
        handle_until(2)
        assert handled == ["overtaking", "in order"] and pipeline.answered_through(1)
    finally:
        for gate in ranks.answer_now:
            gate.set()
        pipeline.drain()
    assert len(pipeline) == 0
