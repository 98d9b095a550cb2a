"""The ticket in kv_transfer_params survives a JSON round trip; bad fields are named."""

import json

import pytest

from transfer.errors import InvalidInput
from transfer.vllm.ticket import Ticket


def ticket() -> Ticket:
    return Ticket("127.0.0.1:5000", "req-1", ((3, 7), (2,)), 100, 2, "abc")


def test_round_trip_through_json():
    params = json.loads(json.dumps(ticket().to_params()))
    assert Ticket.from_params(params) == ticket()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tp_size", 0),
        ("num_tokens", True),
        ("request_id", ""),
        ("block_ids", [[1, -1]]),
        ("staged_offsets", [4096]),  # one offset for two prefill ranks
        ("staged_offsets", [4096, -1]),
        ("digest_offsets", [4096, 8192, 0]),  # three offsets for two prefill ranks
        ("digest_offsets", "4096"),
    ],
)
def test_bad_field_is_named(field, value):
    params = ticket().to_params()
    params["pdxfer"][field] = value
    with pytest.raises(InvalidInput, match=field):
        Ticket.from_params(params)


def test_staged_offsets_cross_and_default_to_none():
    staged = Ticket("127.0.0.1:5000", "req-1", ((3, 7), (2,)), 100, 2, "abc", (4096, 8192))
    assert Ticket.from_params(json.loads(json.dumps(staged.to_params()))) == staged
    older = ticket().to_params()
    del older["pdxfer"]["staged_offsets"]  # from a prefill that stages nothing
    assert Ticket.from_params(older).staged_offsets == ()


def test_digest_offsets_cross_and_default_to_none():
    verified = Ticket(
        "127.0.0.1:5000", "req-1", ((3, 7), (2,)), 100, 2, "abc", digest_offsets=(64, 128)
    )
    assert Ticket.from_params(json.loads(json.dumps(verified.to_params()))) == verified
    older = ticket().to_params()
    del older["pdxfer"]["digest_offsets"]  # from a prefill with verify off
    assert Ticket.from_params(older).digest_offsets == ()


def test_missing_ticket_is_named():
    with pytest.raises(InvalidInput, match="kv_transfer_params.pdxfer"):
        Ticket.from_params({"do_remote_decode": True})
