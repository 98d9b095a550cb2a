"""A Stage never waits behind a prefill batch (issue 33: it is on decode's exposed path):
while a batch runs it is refused at once with RESOURCE_EXHAUSTED, so decode reads the
ranges directly; between steps its gather goes out in a step of its own, ahead of the
prefill that is waiting. Every assertion counts steps, never seconds."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.support.prefill_fakes import TIMEOUT_S, fake_instance, hold
from transfer.control.errors import status_code_name
from transfer.control.types import PrefillRequest
from transfer.errors import CapacityError, Closed
from transfer.serving.engine.prefill_engine import PrefillEngine
from transfer.serving.ranks.spec import Copies

COPIES = (Copies(*(np.array(v, dtype=np.int64) for v in ([0, 64], [0, 32], [32, 16]))),)


@pytest.fixture
def engine_and_worker():
    instance, worker = fake_instance(100, staging_bytes=1 << 20)
    engine = PrefillEngine(instance, "prefill-test", "127.0.0.1:1", 30.0)
    yield engine, worker
    engine.close()


def ticket_of(engine: PrefillEngine, rid: str, n: int = 20):
    outcome = engine.submit(PrefillRequest(rid, tuple(range(1, n + 1)), 4)).out.get(
        timeout=TIMEOUT_S
    )
    assert not isinstance(outcome, BaseException), outcome
    return outcome


def test_a_stage_during_a_running_batch_is_refused_at_once_and_takes_nothing(engine_and_worker):
    engine, worker = engine_and_worker
    ticket_of(engine, "s")
    running, gate = threading.Event(), threading.Event()
    worker.on_step = lambda n: n == 1 and (running.set(), gate.wait(TIMEOUT_S))
    later = engine.submit(PrefillRequest("later", tuple(range(1, 21)), 4))
    assert running.wait(TIMEOUT_S)  # its batch is at the (fake) ranks
    try:
        refused = engine.stage("s", COPIES, 48)
        assert refused.done()  # answered without waiting for the batch
        error = refused.exception(0)
        assert isinstance(error, CapacityError)
        assert status_code_name(error) == "RESOURCE_EXHAUSTED"
        staging = engine.instance.staging
        assert staging.free_bytes == staging.capacity_bytes and not staging.holds("s")
    finally:
        gate.set()
    assert not isinstance(later.out.get(timeout=TIMEOUT_S), BaseException)
    assert engine.settle(TIMEOUT_S)  # the batch's step is answered: staging is open again
    offset = engine.stage("s", COPIES, 48).result(TIMEOUT_S)
    assert worker.log[-1][1:] == ("stage", (offset, offset + 32))
    for rid in ("s", "later"):
        engine.store.abort(rid, "test")
    assert engine.settle(TIMEOUT_S)


def test_a_stage_between_steps_goes_in_its_own_step_ahead_of_the_waiting_prefill(
    engine_and_worker,
):
    engine, worker = engine_and_worker
    ticket_of(engine, "s")
    with hold(engine):
        waiting = engine.submit(PrefillRequest("waiting", tuple(range(1, 21)), 4))
        staged = engine.stage("s", COPIES, 48)
    offset = staged.result(TIMEOUT_S)
    assert not isinstance(waiting.out.get(timeout=TIMEOUT_S), BaseException)
    (stage_step,) = [e[0] for e in worker.log if e[1] == "stage"]
    assert [e[1:] for e in worker.log if e[0] == stage_step] == [("stage", (offset, offset + 32))]
    prefill_steps = [e[0] for e in worker.log if e[1] == "prefill"]
    assert stage_step + 1 in prefill_steps  # the waiting prompt ran in the very next step
    for rid in ("s", "waiting"):
        engine.store.abort(rid, "test")
    assert engine.settle(TIMEOUT_S)


def test_a_stage_after_close_fails_closed(engine_and_worker):
    engine, _ = engine_and_worker
    engine.close()
    with pytest.raises(Closed):
        engine.stage("s", COPIES, 48)
