"""DecodeMany: every decode of a client shares one call, yet each reads its own events,
fails alone, and is cancelled alone."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from transfer.control import convert
from transfer.control.client import DecodeClient
from transfer.control.errors import ControlError
from transfer.control.gen import worker_pb2, worker_pb2_grpc
from transfer.control.server import serve
from transfer.control.types import DecodeRequest, Ticket, TokenEvent
from transfer.errors import CapacityError

TIMEOUT_S = 10.0


def _ticket(request_id: str) -> Ticket:
    return Ticket(request_id, "p0", (0,), 0, 1, 1, 1e9)


class FakeDecodes:
    """decode(): `max_tokens` events of tokens 1000*k + i for request "r<k>", with per-id
    behaviour: "fail-*" raises after one token, "full-*" raises CapacityError first, "slow-*"
    never ends on its own (a token every 5 ms). Records which thread ran each and which
    generators were closed."""

    def __init__(self) -> None:
        self.threads: dict[str, str] = {}
        self.closed: queue.SimpleQueue = queue.SimpleQueue()

    def __call__(self, request: DecodeRequest):
        request_id = request.ticket.request_id
        self.threads[request_id] = threading.current_thread().name
        base = 1000 * int(request_id.split("-")[-1])
        try:
            if request_id.startswith("full-"):
                raise CapacityError("max_num_seqs: 0 free of 4")
            i = 0
            while request_id.startswith("slow-") or i < request.max_tokens:
                if request_id.startswith("fail-") and i == 1:
                    raise ControlError("NOT_FOUND", f"prefill p0: {request_id} lost its peer")
                yield TokenEvent(request_id, base + i, i, i == request.max_tokens - 1)
                i += 1
                if request_id.startswith("slow-"):
                    time.sleep(0.005)
        finally:
            self.closed.put(request_id)


@pytest.fixture
def decode_server():
    decodes = FakeDecodes()
    server = serve("127.0.0.1:0", decode=decodes)
    client = DecodeClient(server.address)
    try:
        yield server, client, decodes
    finally:
        client.close()
        server.stop(0)


def _tokens(client: DecodeClient, request_id: str, max_tokens: int) -> list[int]:
    return [e.token for e in client.decode(DecodeRequest(_ticket(request_id), max_tokens))]


def test_concurrent_decodes_each_get_their_own_tokens(decode_server):
    server, client, decodes = decode_server
    with ThreadPoolExecutor(16) as pool:
        futures = {k: pool.submit(_tokens, client, f"r-{k}", 5 + k % 3) for k in range(32)}
        got = {k: f.result(timeout=TIMEOUT_S) for k, f in futures.items()}
    assert got == {k: [1000 * k + i for i in range(5 + k % 3)] for k in range(32)}
    # every one ran on DecodeMany's threads, none as a Decode call of its own
    assert all(name.startswith("decode-many-") for name in decodes.threads.values())
    with grpc.insecure_channel(server.address) as channel:  # the unary Decode call still serves
        request = convert.decode_request_to_pb(DecodeRequest(_ticket("r-40"), 3))
        replies = worker_pb2_grpc.DecodeServiceStub(channel).Decode(request, timeout=TIMEOUT_S)
        alone = [convert.token_event_from_pb(reply) for reply in replies]
    assert [e.token for e in alone] == [40000, 40001, 40002] and alone[-1].finished


def test_a_failing_decode_fails_alone_with_its_code(decode_server):
    _, client, _ = decode_server
    slow = client.decode(DecodeRequest(_ticket("slow-1"), 10**6))
    assert next(slow).token == 1000
    failing = client.decode(DecodeRequest(_ticket("fail-2"), 5))
    assert next(failing).token == 2000
    with pytest.raises(ControlError) as info:
        next(failing)
    assert info.value.code == "NOT_FOUND" and "lost its peer" in info.value.details
    with pytest.raises(ControlError) as info:
        next(iter(client.decode(DecodeRequest(_ticket("full-3"), 5))))
    assert info.value.code == "RESOURCE_EXHAUSTED" and "max_num_seqs" in info.value.details
    assert [next(slow).index for _ in range(3)] == [1, 2, 3]  # the other one runs on
    slow.close()
    assert _tokens(client, "r-4", 2) == [4000, 4001]


def test_a_caller_that_stops_early_cancels_its_decode_only(decode_server):
    _, client, decodes = decode_server
    kept = client.decode(DecodeRequest(_ticket("slow-1"), 10**6))
    left = client.decode(DecodeRequest(_ticket("slow-2"), 10**6))
    assert next(kept).token == 1000 and next(left).token == 2000
    left.close()
    assert decodes.closed.get(timeout=TIMEOUT_S) == "slow-2"  # its cleanup ran on the server
    assert next(kept).index == 1
    kept.close()
    assert decodes.closed.get(timeout=TIMEOUT_S) == "slow-1"


def test_coroutines_share_the_call_fail_alone_and_cancel_alone(decode_server):
    """`adecode`: the same stream for coroutines, whose events reach their event loop."""
    _, client, decodes = decode_server

    async def run() -> None:
        kept = client.adecode(DecodeRequest(_ticket("slow-1"), 10**6))
        left = client.adecode(DecodeRequest(_ticket("slow-2"), 10**6))
        assert (await anext(kept)).token == 1000 and (await anext(left)).token == 2000
        failing = client.adecode(DecodeRequest(_ticket("fail-3"), 5))
        assert (await anext(failing)).token == 3000
        with pytest.raises(ControlError) as info:
            await anext(failing)
        assert info.value.code == "NOT_FOUND"
        await left.aclose()
        assert await asyncio.to_thread(decodes.closed.get, timeout=TIMEOUT_S) == "fail-3"
        assert await asyncio.to_thread(decodes.closed.get, timeout=TIMEOUT_S) == "slow-2"
        assert (await anext(kept)).index == 1
        await kept.aclose()
        assert await asyncio.to_thread(decodes.closed.get, timeout=TIMEOUT_S) == "slow-1"
        events = client.adecode(DecodeRequest(_ticket("r-4"), 2))
        assert [e.token async for e in events] == [4000, 4001]

    asyncio.run(asyncio.wait_for(run(), TIMEOUT_S * 3))


def test_decodes_in_flight_fail_when_the_instance_goes_and_a_new_call_follows(decode_server):
    server, client, _ = decode_server
    slow = client.decode(DecodeRequest(_ticket("slow-1"), 10**6))
    assert next(slow).token == 1000
    port = server.port
    server.stop(0)
    with pytest.raises(ControlError) as info:
        for _ in slow:
            pass
    assert info.value.code in ("UNAVAILABLE", "CANCELLED")
    again = serve(f"127.0.0.1:{port}", decode=FakeDecodes())
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:  # the channel dials the restarted instance again within its backoff
            try:
                assert _tokens(client, "r-2", 2) == [2000, 2001]
                break
            except ControlError as exc:
                assert exc.code == "UNAVAILABLE" and time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        again.stop(0)


def test_a_draining_instance_starts_nothing_new_on_an_open_call(decode_server):
    server, client, _ = decode_server
    running = client.decode(DecodeRequest(_ticket("slow-1"), 10**6))
    assert next(running).token == 1000  # the call is open
    server.set_serving(False)
    with pytest.raises(ControlError) as info:
        _tokens(client, "r-2", 2)
    assert info.value.code == "UNAVAILABLE" and "shutting down" in info.value.details
    assert next(running).index == 1  # what runs keeps running until the server stops
    running.close()


def test_a_stream_id_still_running_is_refused(decode_server):
    server, _, _ = decode_server
    outgoing: queue.SimpleQueue = queue.SimpleQueue()
    start = convert.decode_request_to_pb(DecodeRequest(_ticket("slow-1"), 10**6))
    with grpc.insecure_channel(server.address) as channel:
        call = worker_pb2_grpc.DecodeServiceStub(channel).DecodeMany(
            iter(outgoing.get, None), timeout=TIMEOUT_S
        )
        outgoing.put(worker_pb2.DecodeCall(stream_id=7, start=start))
        outgoing.put(worker_pb2.DecodeCall(stream_id=7, start=start))
        ends = []
        for message in call:
            ends += [e.end for e in message.events if e.stream_id == 7 and e.HasField("end")]
            if ends:
                break
        assert ends[0].code == "INVALID_ARGUMENT" and "stream_id: 7" in ends[0].details
        outgoing.put(worker_pb2.DecodeCall(stream_id=7, cancel=True))
        outgoing.put(None)
        call.cancel()
