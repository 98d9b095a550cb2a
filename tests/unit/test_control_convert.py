"""protobuf <-> dataclass conversion: lossless round trips, malformed fields named."""

from __future__ import annotations

import re

import pytest

from transfer.control import convert
from transfer.control.gen import transfer_pb2, worker_pb2
from transfer.control.types import (
    ControlConfig,
    DecodeRequest,
    GenerateRequest,
    HandshakeReply,
    HandshakeRequest,
    PrefillRequest,
    RankGather,
    StageRequest,
    Ticket,
    TokenEvent,
    compat_hash,
    compat_mismatch,
    make_compat,
)
from transfer.errors import InvalidInput

TICKET = Ticket("r1", "p0", (7, 3, 9), 4, 40, 1234, 1.7e9 + 0.25, "10.0.0.1:50051")
COMPAT = make_compat(geometry="qwen3-next/tp2", dtypes="bf16/fp32", block_size=16, layout_version=3)


@pytest.mark.parametrize(
    ("value", "to_pb", "from_pb"),
    [
        (TICKET, convert.ticket_to_pb, convert.ticket_from_pb),
        (
            HandshakeRequest("d0", COMPAT, compat_hash(COMPAT)),
            convert.handshake_request_to_pb,
            convert.handshake_request_from_pb,
        ),
        (
            HandshakeReply(
                "p0", COMPAT, compat_hash(COMPAT), (b"\x00meta0", b"meta1"), (b"layout0", b"")
            ),
            convert.handshake_reply_to_pb,
            convert.handshake_reply_from_pb,
        ),
        (
            PrefillRequest("r1", (1, 2, 3), 8),
            convert.prefill_request_to_pb,
            convert.prefill_request_from_pb,
        ),
        (
            GenerateRequest("r1", (5,), 1),
            convert.generate_request_to_pb,
            convert.generate_request_from_pb,
        ),
        (DecodeRequest(TICKET, 16), convert.decode_request_to_pb, convert.decode_request_from_pb),
        (
            TokenEvent("r1", 11, 0, False, 12.5, 3.25, 1 << 33, 4096, 7),
            convert.token_event_to_pb,
            convert.token_event_from_pb,
        ),
    ],
)
def test_round_trip_through_bytes(value, to_pb, from_pb):
    message = to_pb(value)
    parsed = type(message).FromString(message.SerializeToString())
    assert from_pb(parsed) == value


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (transfer_pb2.Ticket(request_id="", num_tokens=1), "request_id"),
        (transfer_pb2.Ticket(request_id="r", block_ids=[1, -2], num_tokens=1), r"block_ids\[1\]"),
        (transfer_pb2.Ticket(request_id="r", slot_id=-1, num_tokens=1), "slot_id"),
        (transfer_pb2.Ticket(request_id="r", num_tokens=0), "num_tokens"),
        (transfer_pb2.Ticket(request_id="r", num_tokens=1, first_token=-1), "first_token"),
        (
            transfer_pb2.Ticket(request_id="r", num_tokens=1, lease_deadline=float("inf")),
            "lease_deadline",
        ),
    ],
)
def test_malformed_ticket_names_the_field(message, field):
    with pytest.raises(ValueError, match=field):
        convert.ticket_from_pb(message)


@pytest.mark.parametrize(
    ("message", "from_pb", "field"),
    [
        (
            worker_pb2.PrefillRequest(request_id="r", max_tokens=1),
            convert.prefill_request_from_pb,
            "prompt_ids",
        ),
        (
            worker_pb2.PrefillRequest(request_id="r", prompt_ids=[1, -1], max_tokens=1),
            convert.prefill_request_from_pb,
            r"prompt_ids\[1\]",
        ),
        (
            worker_pb2.GenerateRequest(request_id="r", prompt_ids=[1]),
            convert.generate_request_from_pb,
            "max_tokens",
        ),
        (
            worker_pb2.GenerateRequest(prompt_ids=[1], max_tokens=1),
            convert.generate_request_from_pb,
            "request_id",
        ),
        (worker_pb2.DecodeRequest(max_tokens=1), convert.decode_request_from_pb, "ticket"),
        (
            worker_pb2.DecodeRequest(
                ticket=transfer_pb2.Ticket(request_id="r", num_tokens=0), max_tokens=1
            ),
            convert.decode_request_from_pb,
            r"ticket\.num_tokens",
        ),
        (transfer_pb2.HandshakeRequest(), convert.handshake_request_from_pb, "instance_id"),
    ],
)
def test_malformed_requests_name_the_field(message, from_pb, field):
    with pytest.raises(ValueError, match=field):
        from_pb(message)


def test_compat_hash_is_order_free_and_field_sensitive():
    assert compat_hash(dict(reversed(list(COMPAT.items())))) == compat_hash(COMPAT)
    assert compat_hash(COMPAT | {"block_size": "32"}) != compat_hash(COMPAT)
    other = COMPAT | {"dtypes": "fp16", "extra": "x"}
    assert compat_mismatch(COMPAT, other) == ["dtypes", "extra"]
    assert COMPAT["wire_version"] == "1" and set(COMPAT) == {
        "geometry",
        "dtypes",
        "block_size",
        "layout_version",
        "wire_version",
    }
    with pytest.raises(ValueError, match="compat.geometry"):
        make_compat(geometry="", dtypes="bf16", block_size=16, layout_version=1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(num_kv_blocks=0), "num_kv_blocks"),
        (dict(num_state_slots=-1), "num_state_slots"),
        (dict(block_size=2.5), "block_size"),
        (dict(max_blocks_per_request=True), "max_blocks_per_request"),
        (dict(lease_s=0), "lease_s"),
        (dict(lease_s=float("inf")), "lease_s"),
    ],
)
def test_config_rejects_bad_bounds(kwargs, field):
    args = (
        dict(num_kv_blocks=8, num_state_slots=2, block_size=16, max_blocks_per_request=4) | kwargs
    )
    with pytest.raises(ValueError, match=field):
        ControlConfig(**args)


STAGE = StageRequest("r1", "d0", (RankGather((0, 4096), (64, 128)), RankGather((), ())))


def test_stage_request_round_trip_and_extent():
    assert convert.stage_request_from_pb(convert.stage_request_to_pb(STAGE)) == STAGE
    assert STAGE.nbytes == 192  # the busiest rank's bytes: one extent per rank


@pytest.mark.parametrize(
    ("ranks", "field"),
    [
        ([transfer_pb2.RankGather(src_offsets=[0, 8], lengths=[4])], "ranks[0]: 2 src_offsets"),
        ([transfer_pb2.RankGather(src_offsets=[-1], lengths=[4])], "ranks[0].src_offsets[0]"),
        ([transfer_pb2.RankGather(src_offsets=[0], lengths=[0])], "ranks[0].lengths[0]"),
        (
            [transfer_pb2.RankGather(), transfer_pb2.RankGather(src_offsets=[0], lengths=[-3])],
            "ranks[1].lengths[0]",
        ),
    ],
)
def test_stage_request_names_the_malformed_field(ranks, field):
    message = transfer_pb2.StageRequest(request_id="r1", holder="d0", ranks=ranks)
    with pytest.raises(InvalidInput, match=re.escape(field)):
        convert.stage_request_from_pb(message)


def test_stage_request_needs_its_ids():
    with pytest.raises(InvalidInput, match="holder"):
        convert.stage_request_from_pb(transfer_pb2.StageRequest(request_id="r1"))
