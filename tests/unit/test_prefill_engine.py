"""PrefillEngine against a fake rank worker (the real EngineStep runs its commands): the
token budget per step, chunking in order, prompts sharing steps, cancellation between
chunks, a failed batch failing only whom it must, frees through the loop in the same step
as the next prefill, admission, and stage gathers. Every assertion counts steps, never
seconds: the engine is held (`hold`) while a test queues what one step must see."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from tests.support.prefill_fakes import TIMEOUT_S, fake_instance, hold
from transfer.control.errors import UnknownRequest, status_code_name
from transfer.control.types import PrefillRequest, Ticket
from transfer.errors import (
    Cancelled,
    CapacityError,
    Closed,
    DeadlineExceeded,
    InvalidInput,
    PdxferError,
    WrongState,
)
from transfer.serving.engine.prefill_engine import PrefillEngine
from transfer.serving.engine.request import PrefillPhase
from transfer.serving.ranks.rank_protocol import RankGroupDead
from transfer.serving.ranks.spec import Copies


@pytest.fixture
def make():
    made = []

    def _make(budget: int, **kwargs):
        instance, worker = fake_instance(budget, **kwargs)
        engine = PrefillEngine(instance, "prefill-test", "127.0.0.1:1", 30.0)
        made.append(engine)
        return engine, worker

    yield _make
    for engine in made:
        engine.close()


def request(rid: str, n: int) -> PrefillRequest:
    return PrefillRequest(rid, tuple(range(1, n + 1)), 4)


def outcome(prompt) -> Ticket | BaseException:
    return prompt.out.get(timeout=TIMEOUT_S)


def assert_all_back(engine: PrefillEngine) -> None:
    assert engine.settle(TIMEOUT_S)
    pools = engine.instance.pools
    assert pools.blocks.num_free == pools.blocks.num_total
    assert pools.slots.num_free == pools.slots.num_total


def test_a_long_prompt_runs_in_chunks_of_the_budget_in_order(make):
    engine, worker = make(budget=64)
    ticket = outcome(engine.submit(request("r", 150)))
    slot = ticket.slot_id
    assert ticket.first_token == 100 * slot + 150
    assert [step[0] for step in worker.steps] == [(slot, 0, 64), (slot, 64, 64), (slot, 128, 22)]


def test_a_chunk_short_of_the_prompt_end_stops_at_a_multiple_of_64(make):
    """Where the chunked scans and attention tiles restart as in one pass; a budget too
    small for that still makes progress."""
    engine, worker = make(budget=100)
    slot = outcome(engine.submit(request("a", 150))).slot_id
    assert [step[0] for step in worker.steps] == [(slot, 0, 64), (slot, 64, 86)]
    engine, worker = make(budget=40)
    slot = outcome(engine.submit(request("b", 100))).slot_id
    assert [step[0] for step in worker.steps] == [(slot, 0, 40), (slot, 40, 24), (slot, 64, 36)]


def test_prompts_queued_together_share_steps_within_the_budget(make):
    engine, worker = make(budget=100)
    lengths = {"p0": 30, "p1": 40, "p2": 50, "p3": 20}
    with hold(engine):
        prompts = {rid: engine.submit(request(rid, n)) for rid, n in lengths.items()}
    tickets = {rid: outcome(p) for rid, p in prompts.items()}
    assert all(t.first_token == 100 * t.slot_id + lengths[rid] for rid, t in tickets.items())
    assert all(sum(n for _, _, n in step) <= 100 for step in worker.steps)
    # the first step holds the first two whole; 30 tokens of the third would stop short of
    # a multiple of 64, so the third leads the second step, with the fourth
    assert [len(step) for step in worker.steps] == [2, 2]
    for rid, n in lengths.items():  # each prompt's chunks are contiguous and complete
        slot = tickets[rid].slot_id
        parts = [(c, k) for step in worker.steps for s, c, k in step if s == slot]
        assert parts[0][0] == 0 and sum(k for _, k in parts) == n
        assert all(a[0] + a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))
    assert engine.steps == 2


def test_a_cancelled_prompt_stops_at_the_next_chunk_and_frees_its_cache(make):
    engine, worker = make(budget=8)
    cancel = threading.Event()
    worker.on_step = lambda n: n == 2 and cancel.set()  # the caller leaves during step 3
    prompt = engine.submit(request("long", 1000), cancel.is_set)
    assert isinstance(outcome(prompt), Cancelled)
    assert len(worker.steps) == 3  # no chunk after the one it left during
    assert prompt.phase is PrefillPhase.DONE
    assert_all_back(engine)
    assert [e[1] for e in worker.log][-1] == "release"


def test_a_batch_that_fails_its_checks_fails_only_the_culprit(make):
    engine, worker = make(budget=1000)
    with hold(engine):
        prompts = [engine.submit(request(f"p{i}", 10)) for i in range(3)]
    worker.bad_slot = 1  # the pools hand out slots 0, 1, 2 in order
    out = [outcome(p) for p in prompts]
    assert isinstance(out[1], InvalidInput) and "slot 1 is broken" in str(out[1])
    assert out[0].first_token == 10 and out[2].first_token == 210
    # the batch of three failed, then each ran alone
    assert [len(step) for step in worker.steps] == [3, 1, 1, 1]
    for ticket in (out[0], out[2]):
        engine.store.abort(ticket.request_id, "test")
    assert_all_back(engine)


def test_a_batch_that_broke_inside_fails_every_prompt_in_it(make):
    """A failure past the checks may have left states half-advanced: none can go on."""
    engine, worker = make(budget=1000)
    worker.broken_slot = 1
    with hold(engine):
        prompts = [engine.submit(request(f"p{i}", 10)) for i in range(3)]
    out = [outcome(p) for p in prompts]
    assert all(isinstance(o, PdxferError) and "broke midway" in str(o) for o in out)
    assert len(worker.steps) == 1
    assert_all_back(engine)


def test_a_dead_rank_group_fails_every_prompt(make):
    engine, worker = make(budget=1000)
    with hold(engine):
        prompts = [engine.submit(request(f"p{i}", 10)) for i in range(2)]
        engine.instance.ranks.dead = True
    assert all(isinstance(outcome(p), RankGroupDead) for p in prompts)
    assert worker.steps == []


def test_a_freed_ticket_goes_back_in_the_same_step_as_the_next_prefill(make):
    """The store's free callback only queues an event; the loop frees the pools at once and
    releases the slot on the ranks in its next step, before that step's prefill reuses it."""
    engine, worker = make(budget=100, num_slots=1)
    engine.store.start()
    first = outcome(engine.submit(request("a", 20)))
    with hold(engine):
        engine.store.abort("a", "test")
        second = engine.submit(request("b", 20))  # needs the only slot
    ticket = outcome(second)
    assert ticket.slot_id == first.slot_id
    step = worker.log[-1][0]
    assert [e[1:] for e in worker.log if e[0] == step] == [
        ("release", first.slot_id), ("prefill", ((ticket.slot_id, 0, 20),)),
    ]  # fmt: skip
    engine.store.abort("b", "test")
    assert_all_back(engine)


def test_a_retry_under_the_same_id_waits_for_the_last_attempts_free(make):
    engine, _ = make(budget=100)
    first = outcome(engine.submit(request("again", 20)))
    with hold(engine):
        retry = engine.submit(request("again", 20))
    with pytest.raises(Exception):  # noqa: B017, PT011 - still waiting: nothing to get
        retry.out.get(timeout=0.2)
    assert retry.phase is PrefillPhase.QUEUED
    engine.store.abort("again", "test")
    second = outcome(retry)
    assert second.first_token == first.first_token
    engine.store.abort("again", "test")
    assert_all_back(engine)


def test_admission_refuses_what_can_never_fit_and_a_full_queue(make):
    engine, _ = make(budget=100, num_blocks=4, num_slots=1, max_queue=1)
    huge = outcome(engine.submit(request("huge", 65)))
    assert isinstance(huge, InvalidInput) and status_code_name(huge) == "INVALID_ARGUMENT"
    assert "need 5 KV blocks of 16; this instance has 4" in str(huge)
    holder = outcome(engine.submit(request("a", 16)))  # the only slot
    with hold(engine):
        waiting = engine.submit(request("b", 16))
        refused = engine.submit(request("c", 16))  # beyond --max-queue 1
    full = outcome(refused)
    assert isinstance(full, CapacityError) and "--max-queue 1" in str(full)
    assert status_code_name(full) == "RESOURCE_EXHAUSTED"
    assert waiting.phase is PrefillPhase.QUEUED and engine.num_waiting == 1
    engine.store.abort("a", "test")
    assert outcome(waiting).slot_id == holder.slot_id
    assert engine.num_waiting == 0
    engine.store.abort("b", "test")
    assert_all_back(engine)


def test_a_prompt_waits_for_room_only_so_long(make):
    engine, _ = make(budget=100, num_slots=1)
    engine.cache.wait_s = 0.0  # its next look at the queue is past the deadline
    outcome(engine.submit(request("a", 16)))
    late = outcome(engine.submit(request("b", 16)))
    assert isinstance(late, DeadlineExceeded) and "no room within 0s" in str(late)
    engine.store.abort("a", "test")
    assert_all_back(engine)


def test_stage_gathers_into_one_extent_in_a_step_and_refuses_unknown_tickets(make):
    engine, worker = make(budget=100, staging_bytes=1 << 20)
    ticket = outcome(engine.submit(request("s", 20)))
    copies = (Copies(*(np.array(v, dtype=np.int64) for v in ([0, 64], [0, 32], [32, 16]))),)
    offset = engine.stage("s", copies, 48).result(TIMEOUT_S)
    assert offset >= 4096 and worker.log[-1][1:] == ("stage", (offset, offset + 32))
    assert engine.instance.staging.free_bytes < engine.instance.staging.capacity_bytes
    with pytest.raises(WrongState, match="already holds an extent"):  # one per ticket
        engine.stage("s", copies, 48).result(TIMEOUT_S)
    with pytest.raises(UnknownRequest):
        engine.stage("nobody", copies, 48).result(TIMEOUT_S)
    engine.store.abort(ticket.request_id, "test")
    assert_all_back(engine)
    assert engine.instance.staging.free_bytes == engine.instance.staging.capacity_bytes


def test_a_dump_snapshot_runs_in_the_step_of_the_last_chunk_before_the_ticket(make, tmp_path):
    """So a stream's ticket, freed as soon as decode has read it, never loses its snapshot."""
    engine, worker = make(budget=64, dump_dir=str(tmp_path))
    ticket = outcome(engine.submit(request("d", 100)))
    last = worker.log[-1][0]
    assert [e[1] for e in worker.log if e[0] == last] == ["prefill", "snapshot"]
    assert [e for e in worker.log if e[1] == "snapshot"] == [(last, "snapshot", "d")]
    engine.store.abort(ticket.request_id, "test")
    assert_all_back(engine)


def test_bad_budget_and_close(make):
    instance, _ = fake_instance(4)
    instance.config = SimpleNamespace(max_num_batched_tokens=0)
    with pytest.raises(InvalidInput, match="max_num_batched_tokens"):
        PrefillEngine(instance, "bad", "127.0.0.1:1", 30.0)
    engine, _ = make(budget=4)
    engine.close()
    with pytest.raises(Closed):
        engine.submit(request("late", 2))
