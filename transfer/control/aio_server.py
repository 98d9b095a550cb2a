"""The router's control server, on grpc.aio.

A router streams one message per generated token to each of its callers. A sync grpc
server wakes two threads for every message (the call's handler, then the server's poller
to complete the send); on grpc.aio one event loop thread sends them all, and a decode
step's tokens reach it in one hand-off (`DecodeMux.adecode`).

The loop runs on a thread of its own, so the rest of the process stays sync:
`serve_router` returns the same ControlServer the sync servers do.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health

from transfer.control.auth import AsyncTokenAuthInterceptor, TlsConfig
from transfer.control.gen import worker_pb2_grpc
from transfer.control.server import (
    ROUTER_SERVICE,
    SERVER_KEEPALIVE_OPTIONS,
    ControlServer,
    Malformed,
    add_common_services,
    guarded_handler,
    host_of,
)
from transfer.control.service import RouterServicer
from transfer.control.types import GenerateRequest, TokenEvent

# How long a sync caller waits for the loop to take a health change or a stop.
LOOP_CALL_TIMEOUT_S = 30.0


def serve_router(
    address: str,
    generate: Callable[[GenerateRequest], AsyncIterator[TokenEvent]],
    *,
    token: str | None = None,
    tls: TlsConfig | None = None,
) -> ControlServer:
    """Start RouterService on `address` ("host:port"; port 0 picks one), with health and
    reflection; `generate` runs on the server's event loop. `token` and `tls` as in
    `transfer.control.server.serve`."""
    host = host_of(address)
    loop = asyncio.new_event_loop()
    stopped = threading.Event()
    threading.Thread(target=_run, args=(loop, stopped), name="router-grpc", daemon=True).start()
    try:
        server, health_servicer, port = _on(loop, _start(address, generate, token, tls))
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        stopped.wait(LOOP_CALL_TIMEOUT_S)
        raise
    started = ControlServer(
        host,
        port,
        (ROUTER_SERVICE,),
        _LoopServer(server, loop, stopped),
        _LoopHealth(health_servicer, loop),
        threading.Event(),
    )
    started.set_serving(True)
    return started


async def _start(address, generate, token, tls):
    interceptors = [AsyncTokenAuthInterceptor(token)] if token else []
    interceptors.append(AsyncMalformedRequestInterceptor())
    server = grpc.aio.server(interceptors=interceptors, options=SERVER_KEEPALIVE_OPTIONS)
    worker_pb2_grpc.add_RouterServiceServicer_to_server(RouterServicer(generate), server)
    health_servicer = health.aio.HealthServicer()
    port = add_common_services(server, health_servicer, [ROUTER_SERVICE], address, tls)
    await server.start()
    return server, health_servicer, port


def _run(loop: asyncio.AbstractEventLoop, stopped: threading.Event) -> None:
    try:
        loop.run_forever()
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
        stopped.set()


def _on(loop: asyncio.AbstractEventLoop, coroutine):
    """Run `coroutine` on `loop` (another thread's) and wait for its result."""
    return asyncio.run_coroutine_threadsafe(coroutine, loop).result(LOOP_CALL_TIMEOUT_S)


class _LoopServer:
    """A grpc.aio server driven from sync code, as ControlServer drives a grpc.Server."""

    def __init__(self, server, loop: asyncio.AbstractEventLoop, stopped: threading.Event):
        self._server = server
        self._loop = loop
        self._stopped = stopped  # set once the loop has closed

    def stop(self, grace: float | None) -> threading.Event:
        if not self._loop.is_running():
            return self._stopped  # stopped already, or stopping
        stopping = asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop)
        stopping.add_done_callback(lambda _: self._loop.call_soon_threadsafe(self._loop.stop))
        return self._stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """True when `timeout` passed first, as grpc.Server's."""
        return not self._stopped.wait(timeout)


class _LoopHealth:
    """grpc_health's aio servicer, set from sync code."""

    def __init__(self, servicer, loop: asyncio.AbstractEventLoop) -> None:
        self._servicer = servicer
        self._loop = loop

    def set(self, service: str, status: int) -> None:
        if self._loop.is_running():  # else the server has stopped, and nobody can ask
            _on(self._loop, self._servicer.set(service, status))

    def enter_graceful_shutdown(self) -> None:
        if self._loop.is_running():
            _on(self._loop, self._servicer.enter_graceful_shutdown())


class AsyncMalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """MalformedRequestInterceptor for a grpc.aio server (handlers that are coroutines or
    async generators)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if inspect.isasyncgenfunction(behavior):

            async def guarded(request, context):
                if isinstance(request, Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
                async for response in behavior(request, context):
                    yield response

        else:  # a coroutine; a streaming one writes with context.write

            async def guarded(request, context):
                if isinstance(request, Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
                return await behavior(request, context)

        return guarded_handler(handler, guarded, handler_call_details.method)
