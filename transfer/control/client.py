"""Control-plane clients. They return frozen dataclasses and raise `ControlError` (status code name + details)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from transfer.control import convert
from transfer.control.auth import TlsConfig, channel_credentials, token_metadata
from transfer.control.decode_mux import DecodeMux
from transfer.control.errors import ControlError, GrpcCode, control_error_of
from transfer.control.gen import transfer_pb2, transfer_pb2_grpc, worker_pb2, worker_pb2_grpc
from transfer.control.types import (
    DecodeRequest,
    GenerateRequest,
    HandshakeReply,
    HandshakeRequest,
    PrefillRequest,
    StageRequest,
    Ticket,
    TokenEvent,
    compat_hash,
)


@dataclass(frozen=True)
class ClientOptions:
    """How a worker or the router reaches a control-plane server."""

    token: str | None = None
    tls: TlsConfig | None = None
    timeout_s: float = 120.0


# How long a caller on its way out (Ctrl-C, the end of a load) waits for a channel's close.
EXIT_CLOSE_WAIT_S = 5.0

KEEPALIVE_OPTIONS = (
    # Ping every 10 s on an open call; a peer whose gRPC stack does not answer within 10 s
    # (dead, frozen, partitioned) fails the call with UNAVAILABLE instead of hanging it.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    # A peer that went away and came back (a supervisor restarted it) is dialled again
    # within a second or two; gRPC's default backoff grows to 120 s, and meanwhile every
    # call fails at once with UNAVAILABLE although the peer is serving again. (Not
    # grpc.min_reconnect_backoff_ms: gRPC also takes it as the connect timeout.)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)


class _Client:
    """One channel to `address`, with optional token and TLS; usable as a context manager."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: TlsConfig | None = None,
        timeout_s: float | None = 10.0,
    ):
        options = list(KEEPALIVE_OPTIONS)
        if tls is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.secure_channel(address, channel_credentials(tls), options=options)
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = token_metadata(token)

    def health(self, service: str = "") -> str:
        """The health status name of `service` ("" = the whole server), e.g. "SERVING"."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        reply = self._call(stub.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the channel connects; raises ControlError("UNAVAILABLE") after `timeout_s`."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ControlError(
                GrpcCode.UNAVAILABLE, f"{self.address} not reachable within {timeout_s}s"
            ) from None

    def close(self, wait_s: float | None = None) -> None:
        """Close the channel, cancelling its calls. With `wait_s`, the close runs on a
        daemon thread and this returns after at most `wait_s`: grpc's close can deadlock
        while other threads still read the channel's streams (grpc/grpc#20026), and a
        caller on its way out (Ctrl-C) must still get to stop what it started."""
        if wait_s is None:
            self._channel.close()
            return
        closer = threading.Thread(target=self._channel.close, name="grpc-close", daemon=True)
        closer.start()
        closer.join(wait_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Callable, request, timeout_s: float | None = None):
        timeout = (
            self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s or timeout_s)
        )
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise control_error_of(err) from None

    def _stream(
        self, method: Callable, request, convert_event: Callable, timeout_s: float | None = None
    ) -> Iterator:
        """Events of a server stream; `timeout_s` bounds the whole stream (keepalive catches
        a dead or frozen server before that)."""
        call = method(request, timeout=timeout_s, metadata=self._metadata)
        try:
            for event in call:
                yield convert_event(event)
        except grpc.RpcError as err:
            raise control_error_of(err) from None
        finally:
            call.cancel()  # a no-op once the stream has ended; stops it if the caller stopped early


class TransferClient(_Client):
    """The decode side's (and router's) view of a prefill instance's TransferService."""

    def __init__(self, address: str, **kwargs):
        super().__init__(address, **kwargs)
        self._stub = transfer_pb2_grpc.TransferServiceStub(self._channel)

    def handshake(
        self, instance_id: str, compat: Mapping[str, str], timeout_s: float | None = None
    ) -> HandshakeReply:
        """Compare `compat` with the prefill instance's; FAILED_PRECONDITION names the fields
        that differ. `timeout_s` shortens the client's deadline."""
        request = HandshakeRequest(
            instance_id=instance_id, compat=dict(compat), compat_hash=compat_hash(compat)
        )
        pb = convert.handshake_request_to_pb(request)
        reply = self._call(self._stub.Handshake, pb, timeout_s)
        return convert.handshake_reply_from_pb(reply)

    def acquire(self, request_id: str, holder: str) -> Ticket:
        reply = self._call(
            self._stub.Acquire, transfer_pb2.AcquireRequest(request_id=request_id, holder=holder)
        )
        return convert.ticket_from_pb(reply)

    def heartbeat(self, request_id: str, holder: str, timeout_s: float | None = None) -> float:
        """Extend the lease; returns the new deadline (unix seconds). `timeout_s` shortens
        the call's deadline (the caller's own deadline is nearer)."""
        request = transfer_pb2.HeartbeatRequest(request_id=request_id, holder=holder)
        return self._call(self._stub.Heartbeat, request, timeout_s).lease_deadline

    def release(
        self, request_id: str, holder: str, block_ids: tuple[int, ...], slot_id: int
    ) -> None:
        """Done reading: the prefill side frees exactly these blocks and slot (they must match the ticket).

        Only a successful release proves the cache stayed allocated for the whole read;
        NOT_FOUND here means the lease expired and what was read must be discarded.
        """
        request = transfer_pb2.ReleaseRequest(
            request_id=request_id, holder=holder, block_ids=list(block_ids), slot_id=slot_id
        )
        self._call(self._stub.Release, request)

    def abort(self, request_id: str, abort_key: str, reason: str = "") -> None:
        """Free the ticket now; `abort_key` is the ticket's (PERMISSION_DENIED otherwise)."""
        request = transfer_pb2.AbortRequest(
            request_id=request_id, reason=reason, abort_key=abort_key
        )
        self._call(self._stub.Abort, request)

    def stage(self, request: StageRequest) -> int:
        """Have the prefill ranks pack these ranges into staging; returns the arena offset
        where each rank's packed bytes start. RESOURCE_EXHAUSTED: read them directly."""
        return self._call(self._stub.Stage, convert.stage_request_to_pb(request)).staging_offset


class PrefillClient(_Client):
    def __init__(self, address: str, **kwargs):
        super().__init__(address, **kwargs)
        self._stub = worker_pb2_grpc.PrefillServiceStub(self._channel)

    def prefill(self, request: PrefillRequest) -> Ticket:
        return convert.ticket_from_pb(
            self._call(self._stub.Prefill, convert.prefill_request_to_pb(request))
        )


class DecodeClient(_Client):
    """A decode instance's DecodeService. Every `decode` shares one DecodeMany call
    (`transfer.control.decode_mux`)."""

    def __init__(self, address: str, **kwargs):
        super().__init__(address, **kwargs)
        self._stub = worker_pb2_grpc.DecodeServiceStub(self._channel)
        self._mux = DecodeMux(lambda calls: self._stub.DecodeMany(calls, metadata=self._metadata))

    def register_prefill(self, addresses: list[str]) -> None:
        """Tell the decode instance which prefill instances (HOST:PORT) it may dial."""
        request = worker_pb2.RegisterPrefillRequest(addresses=list(addresses))
        self._call(self._stub.RegisterPrefill, request)

    def decode(self, request: DecodeRequest) -> Iterator[TokenEvent]:
        """The request's token stream, over the shared DecodeMany call."""
        return self._mux.decode(request)

    def adecode(self, request: DecodeRequest) -> AsyncIterator[TokenEvent]:
        """`decode` for a coroutine on the running event loop."""
        return self._mux.adecode(request)

    def close(self, wait_s: float | None = None) -> None:
        self._mux.close()
        super().close(wait_s)


class RouterClient(_Client):
    def __init__(self, address: str, **kwargs):
        super().__init__(address, **kwargs)
        self._stub = worker_pb2_grpc.RouterServiceStub(self._channel)

    def generate(
        self, request: GenerateRequest, timeout_s: float | None = None
    ) -> Iterator[TokenEvent]:
        """The request's token stream; `timeout_s` bounds the whole stream (None: only
        keepalive ends it)."""
        return self._stream(
            self._stub.Generate,
            convert.generate_request_to_pb(request),
            convert.token_event_from_pb,
            timeout_s=timeout_s,
        )
