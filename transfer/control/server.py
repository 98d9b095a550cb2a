"""Build and run a control-plane gRPC server: the services a worker hosts, plus health and reflection."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from transfer.control.auth import TlsConfig, TokenAuthInterceptor, server_credentials
from transfer.control.decode_many import StartDecode
from transfer.control.gen import transfer_pb2, transfer_pb2_grpc, worker_pb2, worker_pb2_grpc
from transfer.control.service import (
    DecodeServicer,
    PrefillServicer,
    TransferServicer,
)
from transfer.control.tickets import TicketStore
from transfer.control.types import (
    DecodeRequest,
    HandshakeReply,
    PrefillRequest,
    StageRequest,
    Ticket,
    TokenEvent,
)
from transfer.errors import InvalidInput

TRANSFER_SERVICE = transfer_pb2.DESCRIPTOR.services_by_name["TransferService"].full_name
PREFILL_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
DECODE_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
ROUTER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name
# A health-only service name: NOT_SERVING while a TP rank of the instance misses its
# heartbeats. The server ("") stays SERVING then: a slow rank is not a dead one, but a
# router or probe can see it and steer around the instance.
RANKS_HEALTH = "pdxfer.ranks"


class _Server(Protocol):
    """What ControlServer needs of a server: grpc.Server, or an aio one on its own loop."""

    def stop(self, grace: float | None) -> threading.Event: ...

    def wait_for_termination(self, timeout: float | None = None) -> bool: ...


class _Health(Protocol):
    def set(self, service: str, status: int) -> None: ...

    def enter_graceful_shutdown(self) -> None: ...


@dataclass
class ControlServer:
    """A started server. `address` is "host:port" with the port actually bound."""

    host: str
    port: int
    services: tuple[str, ...]
    _server: _Server
    _health: _Health
    # set while NOT_SERVING: calls that are open already (DecodeMany) start nothing new
    _draining: threading.Event

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def set_serving(self, serving: bool) -> None:
        """Flip every health status, e.g. to NOT_SERVING while draining before `stop`;
        while NOT_SERVING, open DecodeMany calls start no new decode either."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.services):
            self._health.set(name, status)
        if serving:
            self._draining.clear()
        else:
            self._draining.set()

    def set_ranks_beating(self, beating: bool) -> None:
        """Say under RANKS_HEALTH whether every TP rank still beats."""
        status = health_pb2.HealthCheckResponse
        self._health.set(RANKS_HEALTH, status.SERVING if beating else status.NOT_SERVING)

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting calls, let running ones finish for `grace` seconds, then wait for shutdown."""
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()

    def wait(self, timeout: float | None = None) -> bool:
        return self._server.wait_for_termination(timeout)


def host_of(address: str) -> str:
    """The host of "host:port"; InvalidInput naming `address` for anything else."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise InvalidInput(f"address: expected 'host:port', got {address!r}")
    return host


def add_common_services(
    server, health_servicer, services: list[str], address: str, tls: TlsConfig | None
) -> int:
    """Health and reflection beside `services`, and the listening port (the one bound)."""
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, server_credentials(tls))
    if port == 0:
        raise InvalidInput(f"address: could not bind {address!r}")
    return port


class MalformedRequestInterceptor(grpc.ServerInterceptor):
    """Answers INVALID_ARGUMENT, instead of grpc's INTERNAL, for request bytes that do not parse.

    Proto3 rejects, for instance, a string field holding invalid UTF-8 while parsing,
    before any servicer code runs.
    """

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary

        def guarded(request, context):
            if isinstance(request, Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
            return behavior(request, context)

        return guarded_handler(handler, guarded, handler_call_details.method)


def guarded_handler(
    handler: grpc.RpcMethodHandler, guarded: Callable, method: str
) -> grpc.RpcMethodHandler:
    """`handler` (unary request) with `guarded` as its behavior, which receives Malformed
    for request bytes that do not parse."""
    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make(
        guarded,
        request_deserializer=safe_parser(handler, method),
        response_serializer=handler.response_serializer,
    )


@dataclass(frozen=True)
class Malformed:
    """What a request that did not parse becomes: the handler aborts with `details`."""

    details: str


def safe_parser(handler: grpc.RpcMethodHandler, method: str) -> Callable[[bytes], object]:
    """The handler's request parser, returning Malformed instead of raising."""
    parse = handler.request_deserializer

    def safe_parse(raw: bytes):
        try:
            return parse(raw)
        except Exception as exc:
            return Malformed(f"request: not a valid message for {method} ({exc})")

    return safe_parse


SERVER_KEEPALIVE_OPTIONS = (
    # Ping a client every 10 s while a call is open: a dead or frozen caller ends its
    # stream within 20 s, which runs the handler's cleanup. Clients ping as often.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
)


def serve(
    address: str,
    *,
    store: TicketStore | None = None,
    identity: HandshakeReply | None = None,
    stage: Callable[[StageRequest], int] | None = None,
    prefill: Callable[[PrefillRequest, Callable[[], bool]], Ticket] | None = None,
    decode: Callable[[DecodeRequest], Iterable[TokenEvent]] | None = None,
    register_prefill: Callable[[list[str]], None] | None = None,
    decode_start: StartDecode | None = None,
    token: str | None = None,
    tls: TlsConfig | None = None,
    max_workers: int = 16,
    health_only: bool = False,
) -> ControlServer:
    """Start a server on `address` ("host:port"; port 0 picks one) hosting the given services.

    `store` + `identity` host TransferService (a prefill instance; `stage` packs a held
    ticket's ranges into staging and returns the extent's offset); `prefill` and
    `decode` host the worker services with dataclass handlers (`decode_start`: an
    engine's submit, which DecodeMany then uses: one message per engine step). The
    router's service runs on grpc.aio instead (`transfer.control.aio_server`). `token`
    requires `authorization: Bearer <token>` on every call except health checks; `tls`
    serves TLS (mTLS when `tls.ca` is set).
    `health_only` allows no other service (a follower node of a multi-node instance).
    """
    host = host_of(address)
    if (store is None) != (identity is None):
        raise InvalidInput("store/identity: TransferService needs both")
    interceptors = [TokenAuthInterceptor(token)] if token else []
    interceptors.append(MalformedRequestInterceptor())
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=interceptors,
        options=SERVER_KEEPALIVE_OPTIONS,
    )
    services: list[str] = []
    draining = threading.Event()
    if store is not None:
        transfer_pb2_grpc.add_TransferServiceServicer_to_server(
            TransferServicer(store, identity, stage), server
        )
        services.append(TRANSFER_SERVICE)
    if prefill is not None:
        abandon = None if store is None else lambda t: store.abort(t.request_id, "caller gone")
        worker_pb2_grpc.add_PrefillServiceServicer_to_server(
            PrefillServicer(prefill, abandon), server
        )
        services.append(PREFILL_SERVICE)
    if decode is not None:
        worker_pb2_grpc.add_DecodeServiceServicer_to_server(
            DecodeServicer(decode, register_prefill, draining, decode_start), server
        )
        services.append(DECODE_SERVICE)
    if not services and not health_only:
        raise InvalidInput("serve: no service to host (give store+identity, prefill or decode)")
    health_servicer = health.HealthServicer()
    port = add_common_services(server, health_servicer, services, address, tls)
    server.start()
    started = ControlServer(host, port, tuple(services), server, health_servicer, draining)
    started.set_serving(True)
    return started
