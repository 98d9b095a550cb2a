"""TicketStore: validation, lifecycle, leases in any deadline order, exactly-once freeing."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.control import (
    ControlConfig,
    FreeReason,
    TicketStateError,
    TicketStore,
    UnknownRequest,
)

CONFIG = ControlConfig(
    num_kv_blocks=32, num_state_slots=8, block_size=4, max_blocks_per_request=4, lease_s=10.0
)


class ManualClock:
    """Unix seconds that move only when a test says so."""

    def __init__(self, now: float = 1_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Freed:
    """The owner's on_free: records every call."""

    def __init__(self):
        self.calls: list[tuple[str, FreeReason]] = []
        self._lock = threading.Lock()

    def __call__(self, ticket, reason):
        with self._lock:
            self.calls.append((ticket.request_id, reason))

    def reasons(self) -> dict[str, FreeReason]:
        return dict(self.calls)


def make_store(clock=None, config=CONFIG):
    freed = Freed()
    return TicketStore(
        config, freed, instance_id="p0", address="p0:1", clock=clock or ManualClock()
    ), freed


def test_publish_fills_the_ticket_and_lease():
    clock = ManualClock(500.0)
    store, _ = make_store(clock)
    ticket = store.publish("r1", [3, 1, 2], 5, 9, first_token=42)
    assert ticket.block_ids == (3, 1, 2) and ticket.slot_id == 5 and ticket.num_tokens == 9
    assert (ticket.instance_id, ticket.address, ticket.first_token) == ("p0", "p0:1", 42)
    assert ticket.lease_deadline == 510.0
    assert store.get("r1") == ticket and len(store) == 1 and store.holder("r1") == ""


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(request_id=""), "request_id"),
        (dict(request_id="a\nb"), "request_id"),
        (dict(request_id="x" * 300), "request_id"),
        (dict(block_ids=[0, 32]), "block_ids[1]"),
        (dict(block_ids=[-1, 2]), "block_ids[0]"),
        (dict(block_ids=[4, 4]), "block_ids[1]"),
        (dict(block_ids=[0, 1, 2]), "block_ids"),  # 3 blocks for 8 tokens at block_size 4
        (dict(block_ids=[0, 1, 2, 3, 4], num_tokens=20), "max_blocks_per_request"),
        (dict(slot_id=8), "slot_id"),
        (dict(slot_id=-1), "slot_id"),
        (dict(num_tokens=0, block_ids=[]), "num_tokens"),
        (dict(first_token=-5), "first_token"),
        (dict(lease_s=0.0), "lease_s"),
        (dict(lease_s=float("nan")), "lease_s"),
    ],
)
def test_publish_rejects_bad_fields_and_changes_nothing(kwargs, field):
    store, freed = make_store()
    store.publish("live", [10, 11], 0, 8, 1)
    args = dict(request_id="r1", block_ids=[0, 1], slot_id=1, num_tokens=8, first_token=1) | kwargs
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        store.publish(**args)
    assert len(store) == 1 and store.get("r1") is None and freed.calls == []
    store.publish("r1", [0, 1], 1, 8, 1)  # the slot and id were not taken by the rejected call


def test_publish_rejects_duplicate_request_and_busy_slot():
    store, _ = make_store()
    store.publish("r1", [0], 0, 3, 1)
    with pytest.raises(ValueError, match="request_id"):
        store.publish("r1", [1], 1, 3, 1)
    with pytest.raises(ValueError, match="slot_id: slot 0 is held by live ticket 'r1'"):
        store.publish("r2", [1], 0, 3, 1)


def test_full_lifecycle_frees_once_on_release():
    clock = ManualClock()
    store, freed = make_store(clock)
    store.publish("r1", [0, 1], 2, 5, 7)
    clock.now += 4
    assert store.acquire("r1", "d0").lease_deadline == clock.now + 10
    store.acquire("r1", "d0")  # a retried acquire by the same holder is idempotent
    assert store.holder("r1") == "d0"
    clock.now += 6
    assert store.heartbeat("r1", "d0").lease_deadline == clock.now + 10
    store.release("r1", "d0", (0, 1), 2)
    assert freed.calls == [("r1", FreeReason.RELEASED)] and len(store) == 0
    with pytest.raises(UnknownRequest, match="already released"):
        store.heartbeat("r1", "d0")
    assert store.reap(clock.now + 1e6) == []


def test_state_errors_change_nothing():
    store, freed = make_store()
    ticket = store.publish("r1", [0, 1], 2, 5, 7)
    with pytest.raises(TicketStateError, match="not acquired"):
        store.heartbeat("r1", "d0")
    with pytest.raises(TicketStateError, match="not acquired"):
        store.release("r1", "d0", (0, 1), 2)
    store.acquire("r1", "d0")
    with pytest.raises(TicketStateError, match="held by 'd0'"):
        store.acquire("r1", "d1")
    with pytest.raises(TicketStateError, match="held by 'd0'"):
        store.release("r1", "d1", (0, 1), 2)
    with pytest.raises(ValueError, match="block_ids: 1 blocks"):
        store.release("r1", "d0", (0,), 2)
    with pytest.raises(ValueError, match=r"block_ids\[1\]: 3 does not match"):
        store.release("r1", "d0", (0, 3), 2)
    with pytest.raises(ValueError, match="slot_id: 3 does not match"):
        store.release("r1", "d0", (0, 1), 3)
    with pytest.raises(ValueError, match=r"block_ids\[1\]: 99 is out of range"):
        store.release("r1", "d0", (0, 99), 2)
    with pytest.raises(UnknownRequest):
        store.abort("nope")
    assert (
        freed.calls == []
        and store.get("r1").block_ids == ticket.block_ids
        and store.holder("r1") == "d0"
    )


def test_abort_frees_in_any_state():
    store, freed = make_store()
    store.publish("published", [0], 0, 1, 1)
    store.publish("acquired", [1], 1, 1, 1)
    store.acquire("acquired", "d0")
    store.abort("published", "router dropped it")
    store.abort("acquired")
    assert freed.reasons() == {"published": FreeReason.ABORTED, "acquired": FreeReason.ABORTED}
    assert len(store) == 0


def test_expiry_out_of_order_deadlines():
    """Bug 10: the first-published ticket has the latest deadline; the others must still expire."""
    clock = ManualClock(0.0)
    store, freed = make_store(clock)
    for request_id, lease, slot in [
        ("late", 30.0, 0),
        ("early", 5.0, 1),
        ("middle", 12.0, 2),
        ("earliest", 1.0, 3),
    ]:
        store.publish(request_id, [slot], slot, 2, 1, lease_s=lease)
    assert [t.request_id for t in store.reap(4.0)] == ["earliest"]
    assert [t.request_id for t in store.reap(12.0)] == ["early", "middle"]
    assert store.get("late") is not None and len(store) == 1
    assert [t.request_id for t in store.reap(30.0)] == ["late"]
    assert (
        Counter(r for _, r in freed.calls) == {FreeReason.EXPIRED: 4} and store.expired_total == 4
    )


def test_heartbeat_moves_a_lease_past_later_ones():
    clock = ManualClock(0.0)
    store, freed = make_store(clock)
    store.publish("a", [0], 0, 1, 1, lease_s=2.0)
    store.publish("b", [1], 1, 1, 1, lease_s=8.0)
    store.acquire("a", "d0")  # deadline 10
    assert [t.request_id for t in store.reap(9.0)] == ["b"]
    assert freed.reasons() == {"b": FreeReason.EXPIRED}
    clock.now = 9.0
    store.heartbeat("a", "d0")  # deadline 19; the entries at 2 and 10 are stale
    assert store.reap(18.9) == [] and store.get("a") is not None
    assert [t.request_id for t in store.reap(19.0)] == ["a"]


def test_stale_heap_entries_are_compacted():
    clock = ManualClock(0.0)
    store, _ = make_store(clock)
    store.publish("r", [0], 0, 1, 1)
    store.acquire("r", "d0")
    for _ in range(500):
        clock.now += 0.01
        store.heartbeat("r", "d0")
    store.reap(clock.now)
    assert len(store._heap) <= 2 * len(store) + 64


def test_release_abort_and_expiry_race_frees_once():
    clock = ManualClock(0.0)
    store, freed = make_store(clock, ControlConfig(64, 64, 1, 1, lease_s=1.0))
    for i in range(64):
        store.publish(f"r{i}", [i], i, 1, 1)
        store.acquire(f"r{i}", "d0")
    barrier = threading.Barrier(3)
    errors: list[BaseException] = []

    def run(fn):
        barrier.wait()
        for i in range(64):
            try:
                fn(i)
            except (UnknownRequest, TicketStateError):
                pass
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(lambda i: store.release(f"r{i}", "d0", (i,), i),)),
        threading.Thread(target=run, args=(lambda i: store.abort(f"r{i}"),)),
        threading.Thread(target=run, args=(lambda i: store.reap(10.0),)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    assert Counter(request_id for request_id, _ in freed.calls) == {f"r{i}": 1 for i in range(64)}
    assert len(store) == 0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["publish", "heartbeat", "release", "abort", "tick"]),
            st.integers(0, 5),
            st.floats(0.1, 20),
        ),
        max_size=60,
    )
)
def test_leases_match_a_model(ops):
    """Against a dict model: a ticket is freed once, exactly when its latest deadline has passed or it is dropped."""
    clock = ManualClock(0.0)
    store, freed = make_store(clock, ControlConfig(8, 8, 1, 1, lease_s=5.0))
    deadline: dict[str, float] = {}
    published: Counter[str] = Counter()
    for op, n, dt in ops:
        rid = f"r{n}"
        if op == "publish" and rid not in deadline:
            store.publish(rid, [n], n, 1, 1, lease_s=dt)
            store.acquire(rid, "d0")
            published[rid] += 1
            deadline[rid] = max(clock.now + dt, clock.now + 5.0)
        elif op == "heartbeat" and rid in deadline:
            store.heartbeat(rid, "d0")
            deadline[rid] = max(deadline[rid], clock.now + 5.0)
        elif op in ("release", "abort") and rid in deadline:
            if op == "release":
                store.release(rid, "d0", (n,), n)
            else:
                store.abort(rid)
            del deadline[rid]
        elif op == "tick":
            clock.now += dt
            reaped = {t.request_id for t in store.reap()}
            due = {r for r, d in deadline.items() if d <= clock.now}
            assert reaped == due
            for r in due:
                del deadline[r]
        assert {r: store.get(r).lease_deadline for r in deadline} == deadline
    freed_per_id = Counter(r for r, _ in freed.calls)
    assert (
        freed_per_id + Counter(deadline.keys()) == published
    )  # each publish freed once, or still live
    assert len(store) == len(deadline)


def test_reaper_thread_frees_expired_and_stops():
    freed = Freed()
    store = TicketStore(CONFIG, freed, max_wait_s=0.05)
    store.publish("short", [0], 0, 1, 1, lease_s=0.05)
    store.publish("long", [1], 1, 1, 1, lease_s=600.0)
    with store:
        end = time.monotonic() + 10
        while not freed.calls and time.monotonic() < end:
            time.sleep(0.01)
    assert freed.calls == [("short", FreeReason.EXPIRED)]
    assert store._reaper is None and store.get("long") is not None
