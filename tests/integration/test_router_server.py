"""The router's grpc.aio server: RouterService speaks dataclasses, failures become codes,
and health, reflection, drain and stop behave as on the sync servers."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from transfer.control.aio_server import serve_router
from transfer.control.client import RouterClient
from transfer.control.errors import ControlError
from transfer.control.types import GenerateRequest, TokenEvent


async def _generate(request: GenerateRequest):
    if request.request_id == "bad":
        raise ValueError("prompt_ids: too long for this instance")
    for i in range(request.max_tokens):
        if request.request_id == "fail-mid" and i == 1:
            raise ControlError("NOT_FOUND", "prefill p0: request fail-mid lost its peer")
        await asyncio.sleep(0)
        yield TokenEvent(request.request_id, 100 + i, i, i == request.max_tokens - 1)


@pytest.fixture
def server():
    server = serve_router("127.0.0.1:0", _generate)
    yield server
    server.stop(0)


def test_generate_streams_dataclasses_and_maps_failures(server):
    with RouterClient(server.address, timeout_s=10) as client:
        events = list(client.generate(GenerateRequest("g1", (4,), 3)))
        assert [(e.token, e.index) for e in events] == [(100, 0), (101, 1), (102, 2)]
        assert events[-1].finished and not events[0].finished
        with pytest.raises(ControlError) as info:
            list(client.generate(GenerateRequest("bad", (4,), 3)))
        assert info.value.code == "INVALID_ARGUMENT" and "prompt_ids" in info.value.details
        stream = client.generate(GenerateRequest("fail-mid", (4,), 3))
        assert next(stream).token == 100
        with pytest.raises(ControlError) as info:
            next(stream)
        assert info.value.code == "NOT_FOUND" and "lost its peer" in info.value.details


def test_unparsable_request_is_invalid_argument(server):
    with grpc.insecure_channel(server.address) as channel:
        raw = channel.unary_stream("/pdxfer.v1.RouterService/Generate")
        with pytest.raises(grpc.RpcError) as info:  # field 1 (request_id) holding invalid UTF-8
            list(raw(b"\x0a\x02\xff\xfe", timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "RouterService/Generate" in info.value.details()


def test_health_reflection_drain_and_stop(server):
    with grpc.insecure_channel(server.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"pdxfer.v1.RouterService", "grpc.health.v1.Health"} <= services
    with RouterClient(server.address, timeout_s=10) as client:
        assert client.health() == "SERVING"
        server.set_serving(False)
        assert client.health() == "NOT_SERVING"
        server.set_serving(True)
        assert client.health() == "SERVING"
    assert server.wait(0.01)  # still running: the wait timed out
    server.stop(0)
    assert not server.wait(10)
    server.stop(0)  # a second stop is a no-op
    with RouterClient(server.address, timeout_s=2) as client, pytest.raises(ControlError) as info:
        list(client.generate(GenerateRequest("late", (4,), 1)))
    assert info.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_streams_are_not_bound_by_threads():
    # Every stream waits until all of them are open: a server with a thread per stream,
    # and fewer threads than streams, would never answer any.
    streams = 48
    opened: list[int] = []
    everyone: asyncio.Event | None = None

    async def generate(request: GenerateRequest):
        nonlocal everyone
        everyone = everyone or asyncio.Event()
        opened.append(1)
        if len(opened) == streams:
            everyone.set()
        await everyone.wait()
        yield TokenEvent(request.request_id, 7, 0, True)

    server = serve_router("127.0.0.1:0", generate)
    try:
        with (
            RouterClient(server.address, timeout_s=20) as client,
            ThreadPoolExecutor(streams) as pool,
        ):
            calls = [
                pool.submit(lambda i=i: list(client.generate(GenerateRequest(f"s{i}", (1,), 1))))
                for i in range(streams)
            ]
            tokens = [[e.token for e in call.result(timeout=30)] for call in calls]
        assert tokens == [[7]] * streams
    finally:
        server.stop(0)
