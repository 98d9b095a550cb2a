"""PeerClient against a real gRPC TransferService: every call answers as one event, calls for
one request keep their order, failures arrive as events carrying the status code."""

from __future__ import annotations

import socket
import threading

import pytest

from transfer.control.client import ClientOptions
from transfer.control.peer_client import PeerClient, PeerEvent, PeerOp
from transfer.control.server import serve
from transfer.control.tickets import TicketStore
from transfer.control.types import ControlConfig, HandshakeReply, compat_hash, make_compat
from transfer.errors import Closed, InvalidInput

COMPAT = make_compat(geometry="tiny", dtypes="bf16", block_size=4, layout_version=1)
TOKEN = "peer-test-token"
WAIT_S = 20.0


@pytest.fixture
def prefill():
    """A prefill instance's TransferService on a free loopback port, with auth."""
    freed: list[tuple[str, str]] = []
    store = TicketStore(
        ControlConfig(64, 8, 4, 16, lease_s=30.0),
        lambda t, reason: freed.append((t.request_id, reason.value)),
        instance_id="p0",
    )
    identity = HandshakeReply("p0", COMPAT, compat_hash(COMPAT), (b"md0",), (b"{}",))
    server = serve("127.0.0.1:0", store=store, identity=identity, token=TOKEN)
    yield server.address, store, freed
    server.stop(grace=None)


def events_until(peers: PeerClient, count: int) -> list[PeerEvent]:
    """Drain until `count` events arrived; bounded by WAIT_S."""
    events: list[PeerEvent] = []
    while len(events) < count:
        assert peers.wait(WAIT_S), f"only {len(events)} of {count} events within {WAIT_S}s"
        events += peers.drain()
    return events


def test_acquire_heartbeat_release_in_order(prefill):
    address, store, freed = prefill
    store.publish("r1", (3, 4), 2, num_tokens=7, first_token=11)
    with PeerClient("d0", ClientOptions(token=TOKEN)) as peers:
        # Submitted back to back: Release must not overtake Acquire.
        peers.acquire(address, "r1", tag="a")
        peers.heartbeat(address, "r1", tag="b")
        peers.release(address, "r1", (3, 4), 2, tag="c")
        events = events_until(peers, 3)
    assert [(e.op, e.tag, e.ok) for e in events] == [
        (PeerOp.ACQUIRE, "a", True),
        (PeerOp.HEARTBEAT, "b", True),
        (PeerOp.RELEASE, "c", True),
    ]
    ticket = events[0].result
    assert (ticket.request_id, ticket.block_ids, ticket.slot_id, ticket.num_tokens) == (
        "r1",
        (3, 4),
        2,
        7,
    )
    assert events[1].result >= ticket.lease_deadline
    assert freed == [("r1", "released")]


def test_failures_are_events_with_the_status_code(prefill):
    address, store, freed = prefill
    store.publish("r2", (5,), 1, num_tokens=3, first_token=0)
    with PeerClient("d0", ClientOptions(token=TOKEN)) as peers:
        peers.acquire(address, "nobody", tag=1)
        peers.release(address, "r2", (5,), 1, tag=2)  # not acquired by d0
        peers.handshake(address, "d0", {**COMPAT, "dtypes": "fp32"}, tag=3)
        events = {e.tag: e for e in events_until(peers, 3)}
    assert events[1].error.code == "NOT_FOUND"
    assert events[2].error.code == "FAILED_PRECONDITION"
    assert events[3].error.code == "FAILED_PRECONDITION" and "dtypes" in events[3].error.details
    assert all(e.result is None for e in events.values())
    assert freed == [] and store.get("r2") is not None  # nothing changed on prefill


def test_handshake_answers_the_identity(prefill):
    address, _, _ = prefill
    with PeerClient("d0", ClientOptions(token=TOKEN)) as peers:
        peers.handshake(address, "d0", COMPAT)
        (event,) = events_until(peers, 1)
    assert event.ok and event.op is PeerOp.HANDSHAKE
    assert event.result.rank_metadata == (b"md0",) and event.result.compat_hash == compat_hash(
        COMPAT
    )


def test_wrong_token_is_refused(prefill):
    address, store, _ = prefill
    store.publish("r3", (6,), 3, num_tokens=2, first_token=0)
    with PeerClient("d0", ClientOptions(token="wrong")) as peers:
        peers.acquire(address, "r3")
        (event,) = events_until(peers, 1)
    assert event.error.code == "UNAUTHENTICATED"
    assert store.holder("r3") == ""


def test_unreachable_peer_fails_within_the_timeout():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with PeerClient("d0", ClientOptions(timeout_s=2.0)) as peers:
        peers.acquire(f"127.0.0.1:{port}", "r4")
        (event,) = events_until(peers, 1)
    assert event.error.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_many_requests_run_side_by_side_and_wake_the_caller(prefill):
    address, store, freed = prefill
    woken = threading.Event()
    for i in range(8):
        store.publish(f"m{i}", (10 + i,), i, num_tokens=1, first_token=0)
    with PeerClient("d0", ClientOptions(token=TOKEN), on_event=woken.set) as peers:
        for i in range(8):
            peers.acquire(address, f"m{i}", tag=i)
        acquired = events_until(peers, 8)
        assert woken.is_set() and peers.pending() == 0
        for e in acquired:
            peers.release(address, e.request_id, e.result.block_ids, e.result.slot_id, tag=e.tag)
        released = events_until(peers, 8)
    assert sorted(e.tag for e in acquired) == list(range(8)) and all(e.ok for e in acquired)
    assert all(e.ok for e in released) and len(store) == 0
    assert sorted(r for r, _ in freed) == [f"m{i}" for i in range(8)]


def test_closed_client_refuses_calls():
    peers = PeerClient("d0")
    peers.close()
    with pytest.raises(Closed):
        peers.acquire("127.0.0.1:1", "r")


def test_keep_alive_renews_a_lease_until_stopped(prefill):
    address, store, _ = prefill
    store.publish("r9", (1,), 0, num_tokens=3, first_token=5)
    with PeerClient("d0", ClientOptions(token=TOKEN)) as peers:
        peers.acquire(address, "r9", tag="a")
        assert [e.op for e in events_until(peers, 1)] == [PeerOp.ACQUIRE]
        peers.keep_alive(address, "r9", 0.05, tag="k")
        beats = events_until(peers, 2)  # two or more, however the timer ran
        assert {(e.op, e.tag, e.ok) for e in beats} == {(PeerOp.HEARTBEAT, "k", True)}
        peers.stop_keep_alive(address, "r9")
        peers.release(address, "r9", (1,), 0, tag="r")
        # Renewals submitted before the stop may still answer; then the release, and no more.
        tail = events_until(peers, 1)
        while tail[-1].op is not PeerOp.RELEASE:
            tail += events_until(peers, 1)
        assert all(e.op is PeerOp.HEARTBEAT for e in tail[:-1]) and tail[-1].ok
        assert not peers.wait(0.3), peers.drain()
        with pytest.raises(InvalidInput, match="interval_s"):
            peers.keep_alive(address, "r9", 0)


def test_a_renewal_that_got_no_answer_is_retried_early():
    """Two missed beats in a row lost a lease still in use: a renewal that failed without an
    answer (UNAVAILABLE, DEADLINE_EXCEEDED) brings the next one forward to a quarter interval."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    with PeerClient("d0", ClientOptions(timeout_s=2.0)) as peers:
        peers.keep_alive(address, "r1", 400.0, tag="k")
        planned = peers.next_renewal(address, "r1")
        peers.heartbeat(address, "r1", tag="now")
        (beat,) = events_until(peers, 1)
        assert beat.error is not None and beat.error.code.name in (
            "UNAVAILABLE",
            "DEADLINE_EXCEEDED",
        )
        retry = peers.next_renewal(address, "r1")
        assert retry is not None and retry <= planned - 250.0
        peers.stop_keep_alive(address, "r1")
        assert peers.next_renewal(address, "r1") is None
