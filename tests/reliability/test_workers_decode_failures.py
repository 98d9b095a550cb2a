"""A decode batch that fails fails only its culprit (tiny model, ranks in real processes):
the ranks refuse every step of one request, as they refuse any step that fails its checks,
and the requests sharing its batch run again alone, then together, each with exactly the
tokens of a run without the fault. Counted in the steps sent, never by the clock."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from tests.support.worker_sides import one_thread, prompt, start_decode, start_prefill  # noqa: F401
from transfer.control.types import DecodeRequest, PrefillRequest
from transfer.errors import InvalidInput
from transfer.model.reference import reference_generate
from transfer.presets import get_preset
from transfer.serving.engine.instance import InstanceConfig
from transfer.serving.engine.step import EngineStep
from transfer.serving.ranks.commands import DecodeBatch

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-next"
MAX_TOKENS = 9
GOOD = ("good-a", "good-b")
BAD = "bad"


def config(role: str) -> InstanceConfig:
    return InstanceConfig(role, get_preset(MODEL), budget_bytes=16 << 20, max_seqs=4)


@pytest.fixture(scope="module")
def pair():
    prefill = start_prefill(config("prefill"), "prefill-failures")
    decode = start_decode(config("decode"), "decode-failures", [prefill])
    yield prefill, decode
    decode.close()
    prefill.close()


def refuse_steps_of(monkeypatch, decode, request_id: str) -> list[list[tuple[int, ...]]]:
    """From now on every decode step of `request_id` names no blocks, which the ranks'
    checks refuse (InvalidInput) before the step writes anything. Returns, per step sent,
    the slots of each of its decode batches."""
    engine, ranks, sent = decode.worker.engine, decode.instance.ranks, []
    submit = ranks.submit

    def refusing(command):
        if isinstance(command, EngineStep):  # on the engine thread: reading `active` is safe
            bad = {r.slot for r in engine.active if r.request_id == request_id}
            batches = [c for c in command.commands if isinstance(c, DecodeBatch)]
            sent.append([tuple(s.slot for s in b.steps) for b in batches])
            command = EngineStep(tuple(
                DecodeBatch(tuple(replace(s, block_ids=()) if s.slot in bad else s
                                  for s in c.steps)) if isinstance(c, DecodeBatch) else c
                for c in command.commands
            ))  # fmt: skip
        return submit(command)

    monkeypatch.setattr(ranks, "submit", refusing)
    return sent


def test_a_failed_batch_runs_its_requests_alone_and_fails_only_the_culprit(pair, monkeypatch):
    prefill, decode = pair
    engine, geometry = decode.worker.engine, get_preset(MODEL)
    names = (*GOOD, BAD)
    ids = {name: prompt(100 + i) for i, name in enumerate(names)}
    tickets = {n: prefill.worker.prefill(PrefillRequest(n, tuple(p), MAX_TOKENS))
               for n, p in ids.items()}  # fmt: skip
    streams = {n: iter(decode.worker.decode(DecodeRequest(t, MAX_TOKENS)))
               for n, t in tickets.items()}  # fmt: skip
    firsts = {name: next(stream).token for name, stream in streams.items()}
    slots = {r.request_id: r.slot for r in engine.active if r.request_id in names}
    sent = refuse_steps_of(monkeypatch, decode, BAD)

    def ready() -> None:  # one engine job: the first decode step holds all three
        for request in engine.active:
            if request.request_id in names:
                request.consumer_ready = True

    engine.call_soon(ready)
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
