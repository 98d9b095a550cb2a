"""TransferServicer logic without a server: protobuf in, protobuf out, typed errors and their status codes."""

from __future__ import annotations

import pytest

from transfer import errors
from transfer.control import (
    CompatMismatch,
    ControlConfig,
    ControlError,
    TicketStateError,
    TicketStore,
    UnknownRequest,
    compat_hash,
    make_compat,
)
from transfer.control.errors import status_code_name
from transfer.control.gen import transfer_pb2 as pb
from transfer.control.service import TransferServicer
from transfer.control.types import HandshakeReply

COMPAT = make_compat(geometry="tiny-gdn/tp1", dtypes="bf16", block_size=4, layout_version=1)


@pytest.fixture
def setup():
    freed = []
    store = TicketStore(
        ControlConfig(16, 4, 4, 4),
        lambda t, r: freed.append((t.request_id, r)),
        instance_id="p0",
        clock=lambda: 100.0,
    )
    identity = HandshakeReply(
        "p0", COMPAT, compat_hash(COMPAT), (b"nixl-md-0", b"nixl-md-1"), (b"L0", b"L1")
    )
    return TransferServicer(store, identity), store, freed


def handshake_request(compat):
    return pb.HandshakeRequest(instance_id="d0", compat=compat, compat_hash=compat_hash(compat))


def test_handshake_returns_rank_metadata(setup):
    servicer, _, _ = setup
    reply = servicer.handshake(handshake_request(COMPAT))
    assert list(reply.rank_metadata) == [b"nixl-md-0", b"nixl-md-1"] and list(
        reply.rank_layouts
    ) == [b"L0", b"L1"]
    assert reply.compat_hash == compat_hash(COMPAT) and reply.instance_id == "p0"


def test_handshake_mismatch_names_every_differing_field(setup):
    servicer, _, _ = setup
    theirs = COMPAT | {"block_size": "16", "wire_version": "2"}
    with pytest.raises(CompatMismatch) as info:
        servicer.handshake(handshake_request(theirs))
    assert info.value.fields == ["block_size", "wire_version"]
    message = str(info.value)
    assert "block_size: decode sent '16'" in message and "geometry" not in message
    assert "'4'" not in message  # the prefill's own values are not echoed
    assert status_code_name(info.value) == "FAILED_PRECONDITION"


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.HandshakeRequest(instance_id="d0", compat=COMPAT, compat_hash="0" * 64), "compat_hash"),
        (
            pb.HandshakeRequest(
                instance_id="d0",
                compat={k: v for k, v in COMPAT.items() if k != "dtypes"},
                compat_hash=compat_hash({k: v for k, v in COMPAT.items() if k != "dtypes"}),
            ),
            "compat.dtypes",
        ),
        (pb.HandshakeRequest(compat=COMPAT, compat_hash=compat_hash(COMPAT)), "instance_id"),
    ],
)
def test_handshake_malformed_is_invalid_argument(setup, request_, field):
    servicer, _, _ = setup
    with pytest.raises(ValueError, match=field) as info:
        servicer.handshake(request_)
    assert status_code_name(info.value) == "INVALID_ARGUMENT"


def test_servicer_rejects_identity_with_a_wrong_hash(setup):
    _, store, _ = setup
    with pytest.raises(ValueError, match="identity.compat_hash"):
        TransferServicer(store, HandshakeReply("p0", COMPAT, "bad"))


def test_ticket_calls_map_to_status_codes_and_change_nothing(setup):
    servicer, store, freed = setup
    store.publish("r1", [1, 2], 3, 5, 9)
    cases = [
        (
            servicer.acquire,
            pb.AcquireRequest(request_id="zz", holder="d0"),
            UnknownRequest,
            "NOT_FOUND",
        ),
        (servicer.acquire, pb.AcquireRequest(request_id="r1"), ValueError, "INVALID_ARGUMENT"),
        (
            servicer.heartbeat,
            pb.HeartbeatRequest(request_id="r1", holder="d0"),
            TicketStateError,
            "FAILED_PRECONDITION",
        ),
        (
            servicer.abort,
            pb.AbortRequest(request_id="", reason="x"),
            ValueError,
            "INVALID_ARGUMENT",
        ),
        (
            servicer.abort,
            pb.AbortRequest(request_id="r1", reason="x" * 2000),
            ValueError,
            "INVALID_ARGUMENT",
        ),
    ]
    for method, request, exc_type, code in cases:
        with pytest.raises(exc_type) as info:
            method(request)
        assert status_code_name(info.value) == code
    assert store.holder("r1") == "" and freed == []


def test_ticket_lifecycle_through_the_servicer(setup):
    servicer, store, freed = setup
    store.publish("r1", [1, 2], 3, 5, 9)
    ticket = servicer.acquire(pb.AcquireRequest(request_id="r1", holder="d0"))
    assert list(ticket.block_ids) == [1, 2] and ticket.slot_id == 3 and ticket.first_token == 9
    assert (
        servicer.heartbeat(pb.HeartbeatRequest(request_id="r1", holder="d0")).lease_deadline
        == 130.0
    )
    with pytest.raises(ValueError, match=r"block_ids\[0\]: 16 is out of range"):
        servicer.release(
            pb.ReleaseRequest(request_id="r1", holder="d0", block_ids=[16, 2], slot_id=3)
        )
    servicer.release(pb.ReleaseRequest(request_id="r1", holder="d0", block_ids=[1, 2], slot_id=3))
    assert [r for r, _ in freed] == ["r1"] and len(store) == 0


@pytest.mark.parametrize(
    "exc, code",
    [
        (ControlError("UNAVAILABLE", "x"), "UNAVAILABLE"),
        (errors.InvalidInput("x"), "INVALID_ARGUMENT"),
        (ValueError("x"), "INVALID_ARGUMENT"),
        (errors.NotFound("x"), "NOT_FOUND"),
        (UnknownRequest("x"), "NOT_FOUND"),
        (errors.WrongState("x"), "FAILED_PRECONDITION"),
        (TicketStateError("x"), "FAILED_PRECONDITION"),
        (CompatMismatch(["dtypes"], "x"), "FAILED_PRECONDITION"),
        (errors.CapacityError("x"), "RESOURCE_EXHAUSTED"),
        (errors.PeerUnavailable("x"), "UNAVAILABLE"),
        (errors.DeadlineExceeded("x"), "DEADLINE_EXCEEDED"),
        (errors.TransferFailed("x", settled=True), "ABORTED"),
        (errors.Closed("x"), "UNAVAILABLE"),
        (RuntimeError("boom"), "INTERNAL"),
    ],
)
def test_status_code_names(exc, code):
    assert status_code_name(exc) == code
