"""A real TransferService on loopback: lifecycle, every bad input, health, reflection, worker services."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from transfer.control import (
    ControlConfig,
    ControlError,
    DecodeRequest,
    FreeReason,
    HandshakeReply,
    PrefillRequest,
    Ticket,
    TicketStore,
    TokenEvent,
    compat_hash,
    make_compat,
)
from transfer.control.client import DecodeClient, PrefillClient, TransferClient
from transfer.control.gen import transfer_pb2
from transfer.control.server import serve

CONFIG = ControlConfig(
    num_kv_blocks=16, num_state_slots=4, block_size=4, max_blocks_per_request=3, lease_s=30.0
)
COMPAT = make_compat(
    geometry="tiny-gdn-gqa/tp2", dtypes="bf16/fp32", block_size=4, layout_version=1
)
IDENTITY = HandshakeReply(
    "prefill-0", COMPAT, compat_hash(COMPAT), (b"md-rank0", b"md-rank1"), (b"lay0", b"lay1")
)


class Pools:
    """The owner's free lists; `free` is what on_free gives back."""

    def __init__(self):
        self.blocks = list(range(CONFIG.num_kv_blocks))
        self.slots = list(range(CONFIG.num_state_slots))
        self.freed: list[tuple[str, FreeReason]] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> tuple[list[int], int]:
        with self._lock:
            blocks, self.blocks = self.blocks[:n], self.blocks[n:]
            return blocks, self.slots.pop(0)

    def free(self, ticket: Ticket, reason: FreeReason) -> None:
        with self._lock:
            assert (
                not set(ticket.block_ids) & set(self.blocks) and ticket.slot_id not in self.slots
            ), "double free"
            self.blocks += ticket.block_ids
            self.slots.append(ticket.slot_id)
            self.freed.append((ticket.request_id, reason))


@pytest.fixture
def prefill():
    pools = Pools()
    store = TicketStore(CONFIG, pools.free, instance_id="prefill-0").start()
    server = serve("127.0.0.1:0", store=store, identity=IDENTITY)
    store.address = server.address
    client = TransferClient(server.address, timeout_s=10)
    yield store, pools, server, client
    client.close()
    server.stop(0)
    store.stop()


def publish(store, pools, request_id, num_tokens=10, first_token=5):
    blocks, slot = pools.take(-(-num_tokens // CONFIG.block_size))
    return store.publish(request_id, blocks, slot, num_tokens, first_token)


def test_full_ticket_lifecycle(prefill):
    store, pools, server, client = prefill
    assert client.health() == "SERVING" and client.health("pdxfer.v1.TransferService") == "SERVING"
    reply = client.handshake("decode-0", COMPAT)
    assert reply.rank_metadata == (b"md-rank0", b"md-rank1") and reply.rank_layouts == (
        b"lay0",
        b"lay1",
    )
    published = publish(store, pools, "req-1")
    assert len(pools.blocks) == 13 and len(pools.slots) == 3
    ticket = client.acquire("req-1", "decode-0")
    assert ticket.block_ids == published.block_ids and ticket.slot_id == published.slot_id
    assert (ticket.first_token, ticket.num_tokens, ticket.address) == (5, 10, server.address)
    assert client.heartbeat("req-1", "decode-0") >= ticket.lease_deadline
    client.release("req-1", "decode-0", ticket.block_ids, ticket.slot_id)
    assert pools.freed == [("req-1", FreeReason.RELEASED)]
    assert (
        sorted(pools.blocks) == list(range(16))
        and sorted(pools.slots) == list(range(4))
        and len(store) == 0
    )
    with pytest.raises(ControlError) as info:
        client.release("req-1", "decode-0", ticket.block_ids, ticket.slot_id)
    assert info.value.code == "NOT_FOUND" and pools.freed == [("req-1", FreeReason.RELEASED)]
    second = publish(store, pools, "req-2")
    client.abort("req-2", second.abort_key, "client went away")
    assert pools.freed[-1] == ("req-2", FreeReason.ABORTED) and len(pools.blocks) == 16


BAD_CALLS = [
    ("acquire unknown", lambda c, t: c.acquire("nope", "decode-0"), "NOT_FOUND", "nope"),
    ("heartbeat unknown", lambda c, t: c.heartbeat("nope", "decode-0"), "NOT_FOUND", "nope"),
    (
        "release unknown",
        lambda c, t: c.release("nope", "decode-0", t.block_ids, t.slot_id),
        "NOT_FOUND",
        "nope",
    ),
    ("abort unknown", lambda c, t: c.abort("nope", ""), "NOT_FOUND", "nope"),
    ("empty request_id", lambda c, t: c.acquire("", "decode-0"), "INVALID_ARGUMENT", "request_id"),
    ("empty holder", lambda c, t: c.heartbeat(t.request_id, ""), "INVALID_ARGUMENT", "holder"),
    (
        "block id out of range",
        lambda c, t: c.release(
            t.request_id, "decode-0", (t.block_ids[0], 16, t.block_ids[2]), t.slot_id
        ),
        "INVALID_ARGUMENT",
        "block_ids[1]",
    ),
    (
        "negative block id",
        lambda c, t: c.release(t.request_id, "decode-0", (-1, *t.block_ids[1:]), t.slot_id),
        "INVALID_ARGUMENT",
        "block_ids[0]",
    ),
    (
        "slot out of range",
        lambda c, t: c.release(t.request_id, "decode-0", t.block_ids, 4),
        "INVALID_ARGUMENT",
        "slot_id",
    ),
    (
        "wrong block count",
        lambda c, t: c.release(t.request_id, "decode-0", t.block_ids[:2], t.slot_id),
        "INVALID_ARGUMENT",
        "block_ids: 2 blocks",
    ),
    (
        "too many blocks",
        lambda c, t: c.release(t.request_id, "decode-0", (*t.block_ids, 15), t.slot_id),
        "INVALID_ARGUMENT",
        "max_blocks_per_request",
    ),
    (
        "another request's blocks",
        lambda c, t: c.release(t.request_id, "decode-0", tuple(reversed(t.block_ids)), t.slot_id),
        "INVALID_ARGUMENT",
        "block_ids[0]",
    ),
    (
        "another request's slot",
        lambda c, t: c.release(t.request_id, "decode-0", t.block_ids, (t.slot_id + 1) % 4),
        "INVALID_ARGUMENT",
        "slot_id",
    ),
    (
        "abort reason too long",
        lambda c, t: c.abort(t.request_id, t.abort_key, "x" * 5000),
        "INVALID_ARGUMENT",
        "reason",
    ),
    (
        "other holder",
        lambda c, t: c.heartbeat(t.request_id, "decode-9"),
        "FAILED_PRECONDITION",
        "decode-9",
    ),
    ("steal", lambda c, t: c.acquire(t.request_id, "decode-9"), "FAILED_PRECONDITION", "held by"),
    (
        "handshake mismatch",
        lambda c, t: c.handshake("decode-0", COMPAT | {"block_size": "16", "dtypes": "fp16"}),
        "FAILED_PRECONDITION",
        "block_size: decode sent '16'; dtypes: decode sent 'fp16'",
    ),
    (
        "handshake missing field",
        lambda c, t: c.handshake("decode-0", {k: v for k, v in COMPAT.items() if k != "geometry"}),
        "INVALID_ARGUMENT",
        "compat.geometry",
    ),
]


@pytest.mark.parametrize(
    ("call", "code", "field"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_input_gets_its_code_and_changes_nothing(prefill, call, code, field):
    store, pools, _, client = prefill
    ticket = publish(store, pools, "req-1")
    client_ticket = client.acquire("req-1", "decode-0")
    before = (
        store.get("req-1"),
        store.holder("req-1"),
        sorted(pools.blocks),
        sorted(pools.slots),
        len(store),
    )
    with pytest.raises(ControlError) as info:
        call(client, client_ticket)
    assert info.value.code == code and field in info.value.details
    after = (
        store.get("req-1"),
        store.holder("req-1"),
        sorted(pools.blocks),
        sorted(pools.slots),
        len(store),
    )
    assert after == before and pools.freed == [] and ticket.block_ids == client_ticket.block_ids


def test_raw_bad_hash_and_unparsable_bytes_are_invalid_argument(prefill):
    store, pools, server, _ = prefill
    publish(store, pools, "req-1")
    with grpc.insecure_channel(server.address) as channel:
        raw = channel.unary_unary("/pdxfer.v1.TransferService/Acquire")
        with pytest.raises(grpc.RpcError) as info:  # field 1 (request_id) holding invalid UTF-8
            raw(b"\x0a\x02\xff\xfe\x12\x02d0", timeout=10)
        assert (
            info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "request" in info.value.details()
        )
        handshake = channel.unary_unary("/pdxfer.v1.TransferService/Handshake")
        bad_hash = transfer_pb2.HandshakeRequest(
            instance_id="d0", compat=COMPAT, compat_hash="f" * 64
        )
        with pytest.raises(grpc.RpcError) as info:
            handshake(bad_hash.SerializeToString(), timeout=10)
        assert (
            info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "compat_hash" in info.value.details()
        )
    assert store.holder("req-1") == "" and pools.freed == []


def test_health_and_reflection(prefill):
    _, _, server, client = prefill
    with grpc.insecure_channel(server.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"pdxfer.v1.TransferService", "grpc.health.v1.Health"} <= services
    server.set_serving(False)
    assert client.health() == "NOT_SERVING"


def test_worker_services_speak_dataclasses():
    def prefill(request: PrefillRequest, is_cancelled=lambda: False) -> Ticket:
        if request.request_id == "bad":
            raise ValueError("prompt_ids: too long for this instance")
        return Ticket(request.request_id, "p0", (0,), 0, len(request.prompt_ids), 99, 1e9, "p0:1")

    def decode(request: DecodeRequest):
        for i in range(request.max_tokens):
            if request.ticket.request_id == "fail-mid" and i == 1:
                raise ControlError(
                    "NOT_FOUND", "prefill p0: request fail-mid lost its peer"
                )  # an upstream call failed
            yield TokenEvent(
                request.ticket.request_id,
                100 + i,
                i,
                i == request.max_tokens - 1,
                kv_bytes=64 * (i == 0),
            )

    server = serve("127.0.0.1:0", prefill=prefill, decode=decode)
    try:
        with PrefillClient(server.address) as p, DecodeClient(server.address) as d:
            ticket = p.prefill(PrefillRequest("r1", (1, 2, 3), 2))
            assert ticket.num_tokens == 3 and ticket.first_token == 99
            events = list(d.decode(DecodeRequest(ticket, 3)))
            assert (
                [e.token for e in events] == [100, 101, 102]
                and events[-1].finished
                and events[0].kv_bytes == 64
            )
            with pytest.raises(ControlError) as info:
                p.prefill(PrefillRequest("bad", (1,), 1))
            assert info.value.code == "INVALID_ARGUMENT" and "prompt_ids" in info.value.details
            with pytest.raises(ControlError) as info:
                p.prefill(PrefillRequest("r2", (), 1))
            assert info.value.code == "INVALID_ARGUMENT" and "prompt_ids" in info.value.details
            stream = d.decode(DecodeRequest(Ticket("fail-mid", "p0", (0,), 0, 1, 1, 1e9), 3))
            assert next(stream).token == 100
            with pytest.raises(ControlError) as info:
                next(stream)
            assert info.value.code == "NOT_FOUND" and "lost its peer" in info.value.details
    finally:
        server.stop(0)
