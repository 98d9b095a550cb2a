"""The decode engine on a real prefill/decode pair (tiny model, ranks in real processes):
who shares a decode step, counted by the engine's own step counters, never by the clock."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from tests.support.worker_sides import one_thread, prompt, start_decode, start_prefill  # noqa: F401
from transfer.control.client import DecodeClient
from transfer.control.errors import ControlError
from transfer.control.types import DecodeRequest, PrefillRequest
from transfer.model.reference import reference_generate
from transfer.presets import get_preset
from transfer.serving.engine.instance import InstanceConfig
from transfer.serving.engine.request import DecodePhase

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-next"
MAX_TOKENS = 9
NAMES = ("a", "b", "c")


def config(role: str) -> InstanceConfig:
    return InstanceConfig(role, get_preset(MODEL), budget_bytes=16 << 20, max_seqs=4)


@pytest.fixture(scope="module")
def pair():
    prefill = start_prefill(config("prefill"), "prefill-engine")
    decode = start_decode(config("decode"), "decode-engine", [prefill])
    yield prefill, decode
    decode.close()
    prefill.close()


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
