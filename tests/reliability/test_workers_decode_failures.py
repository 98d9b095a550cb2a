"""A decode batch that fails fails only the requests it must (tiny model, ranks in real
processes). The ranks refuse every step of one request, as they refuse any step that fails
its checks: the requests sharing its batch run again alone, then together, each with
exactly the tokens of a run without the fault, and only the culprit fails. A batch that
fails after its forward ran ends every request it held: none runs again. Counted in the
batches sent, never by the clock."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from tests.support.worker_sides import one_thread, prompt, running_pair  # noqa: F401
from transfer.control.types import DecodeRequest, PrefillRequest, SamplingParams
from transfer.errors import InvalidInput
from transfer.model.reference import reference_generate
from transfer.presets import get_preset
from transfer.serving.engine.step import EngineStep
from transfer.serving.ranks.commands import DecodeBatch
from transfer.serving.ranks.rank_protocol import RankCommandError

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-next"
MAX_TOKENS = 9
TIMEOUT_S = 30.0
GOOD = ("good-a", "good-b")
BAD = "bad"


@pytest.fixture(scope="module")
def pair():
    with running_pair(MODEL, "failures", max_seqs=4) as sides:
        yield sides


# Every decode step of the bad request names no blocks: the ranks' checks refuse it
# (InvalidInput) before the step writes anything.
REFUSED = {"block_ids": ()}
# Its steps sample (temperature 1) with a broken stream index: the forward runs, writing
# every state of the batch, and then the pick raises (StepFailed).
AFTER_THE_FORWARD = {"sampling": SamplingParams(temperature=1.0, seed=1), "index": 0.5}


def corrupt_steps_of(monkeypatch, decode, request_id: str, fields: dict):
    """From now on every decode step of `request_id` has `fields` replaced. Returns, per
    step sent, the slots of each of its decode batches."""
    engine, ranks, sent = decode.worker.engine, decode.instance.ranks, []
    submit = ranks.submit

    def corrupting(command):
        if isinstance(command, EngineStep):  # on the engine thread: reading `active` is safe
            bad = {r.slot for r in engine.active if r.request_id == request_id}
            batches = [c for c in command.commands if isinstance(c, DecodeBatch)]
            sent.append([tuple(s.slot for s in b.steps) for b in batches])
            command = EngineStep(tuple(
                DecodeBatch(tuple(replace(s, **fields) if s.slot in bad else s
                                  for s in c.steps)) if isinstance(c, DecodeBatch) else c
                for c in command.commands
            ))  # fmt: skip
        return submit(command)

    monkeypatch.setattr(ranks, "submit", corrupting)
    return sent


def start(prefill, decode, names: tuple[str, ...], seed: int):
    """The named requests transferred and holding token 0: (prompts, streams, token 0s)."""
    ids = {name: prompt(seed + i) for i, name in enumerate(names)}
    tickets = {n: prefill.worker.prefill(PrefillRequest(n, tuple(p), MAX_TOKENS))
               for n, p in ids.items()}  # fmt: skip
    streams = {n: iter(decode.worker.decode(DecodeRequest(t, MAX_TOKENS)))
               for n, t in tickets.items()}  # fmt: skip
    return ids, streams, {name: next(stream).token for name, stream in streams.items()}


def decode_together(engine, names: tuple[str, ...]) -> None:
    """Let the named requests decode from one engine job on: one step holds them all."""

    def ready() -> None:
        for request in engine.active:
            if request.request_id in names:
                request.consumer_ready = True

    engine.call_soon(ready)


def wait_slots_free(decode) -> None:
    slots = decode.instance.pools.slots
    deadline = time.monotonic() + TIMEOUT_S
    while slots.num_free != slots.num_total:
        assert time.monotonic() < deadline, f"decode slots not all free within {TIMEOUT_S} s"
        time.sleep(0.05)


def test_a_batch_failing_its_checks_runs_each_alone_and_fails_only_the_culprit(pair, monkeypatch):
    prefill, decode = pair
    engine, geometry = decode.worker.engine, get_preset(MODEL)
    names = (*GOOD, BAD)
    ids, streams, firsts = start(prefill, decode, names, 100)
    slots = {r.request_id: r.slot for r in engine.active if r.request_id in names}
    sent = corrupt_steps_of(monkeypatch, decode, BAD, REFUSED)
    decode_together(engine, names)
    with pytest.raises(InvalidInput, match="need"):
        list(streams[BAD])
    tokens = {name: [firsts[name]] + [e.token for e in streams[name]] for name in GOOD}
    for name in GOOD:  # exactly the tokens of a run without the fault
        assert tokens[name] == reference_generate(geometry, ids[name], MAX_TOKENS), name

    batches = [b for step in sent for b in step]
    every = tuple(sorted(slots.values()))
    assert tuple(sorted(batches[0])) == every, "the first decode batch held all three"
    for name in names:  # after the failed batch, each ran in a batch of its own
        assert (slots[name],) in batches, name
    good = tuple(sorted(slots[n] for n in GOOD))
    last_alone = max(i for i, b in enumerate(batches) if len(b) == 1)
    assert tuple(sorted(batches[-1])) == good, "the good requests shared batches again"
    assert all(len(b) < 3 for b in batches[last_alone:])
    # Each good request lost only the failed step and at most the one sent behind it.
    for name in GOOD:
        ran = sum(slots[name] in b for b in batches)
        assert MAX_TOKENS - 1 < ran <= MAX_TOKENS + 1, (name, ran)
    assert sum(slots[BAD] in b for b in batches) <= 4  # shared twice, alone twice at most
    wait_slots_free(decode)


def test_a_batch_failing_after_its_forward_ends_every_request_it_held(pair, monkeypatch):
    """Its states may be half-advanced: running any of its requests again would advance
    them twice, so none runs again."""
    prefill, decode = pair
    engine = decode.worker.engine
    names = ("late-a", "late-b", "late-bad")
    _, streams, _ = start(prefill, decode, names, 200)
    slots = {r.request_id: r.slot for r in engine.active if r.request_id in names}
    sent = corrupt_steps_of(monkeypatch, decode, "late-bad", AFTER_THE_FORWARD)
    decode_together(engine, names)
    for name in names:
        with pytest.raises(RankCommandError, match="StepFailed") as failed:
            next(streams[name])  # not one token after token 0
        assert failed.value.kind is None, name  # no kind that says "changed nothing"
    batches = [b for step in sent for b in step]
    assert tuple(sorted(batches[0])) == tuple(sorted(slots.values()))
    assert all(len(b) == 3 for b in batches), "a request of the failed batch ran again"
    assert len(batches) <= 2  # the failed step and at most the one sent behind it
    wait_slots_free(decode)
