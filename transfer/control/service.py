"""gRPC servicers: TransferService over a TicketStore, and dataclass adapters for the worker services.

Each RPC converts the request at the edge, calls core code, and maps the
exception it raises to a status code (`errors.status_code_name`). The
lowercase methods hold the logic and speak protobuf in, protobuf out, raising
instead of aborting, so they can be tested without a server.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator

import grpc

from transfer.control import convert
from transfer.control.decode_many import DecodeManyCall, StartDecode
from transfer.control.errors import CompatMismatch, GrpcCode, status_of
from transfer.control.gen import transfer_pb2, transfer_pb2_grpc, worker_pb2, worker_pb2_grpc
from transfer.control.tickets import TicketStore
from transfer.control.types import (
    DecodeRequest,
    GenerateRequest,
    HandshakeReply,
    PrefillRequest,
    StageRequest,
    Ticket,
    TokenEvent,
    compat_hash,
    compat_mismatch,
    validate_compat,
)
from transfer.errors import CapacityError, InvalidInput, WrongState
from transfer.trace import TracePoint, mark

logger = logging.getLogger(__name__)

MAX_REGISTERED = 1024


class TransferServicer(transfer_pb2_grpc.TransferServiceServicer):
    """The prefill side's TransferService. `identity` is what Handshake answers with."""

    def __init__(
        self,
        store: TicketStore,
        identity: HandshakeReply,
        stage: Callable[[StageRequest], int] | None = None,
    ):
        validate_compat(identity.compat, "identity.compat")
        if identity.compat_hash != compat_hash(identity.compat):
            raise InvalidInput("identity.compat_hash: does not match identity.compat")
        self.store = store
        self.identity = identity
        self._stage = stage

    def handshake(self, m: transfer_pb2.HandshakeRequest) -> transfer_pb2.HandshakeReply:
        request = convert.handshake_request_from_pb(m)
        validate_compat(request.compat)
        if request.compat_hash != compat_hash(request.compat):
            raise InvalidInput("compat_hash: does not match the compat fields sent")
        differ = compat_mismatch(self.identity.compat, request.compat)
        if differ:
            # The differing fields and what the caller sent, never the prefill's own values.
            sent = "; ".join(f"{k}: decode sent {request.compat.get(k)!r}" for k in differ)
            raise CompatMismatch(differ, f"incompatible with this prefill instance: {sent}")
        return convert.handshake_reply_to_pb(self.identity)

    def acquire(self, m: transfer_pb2.AcquireRequest) -> transfer_pb2.Ticket:
        mark(TracePoint.ACQUIRE_RECEIVED, m.request_id)
        return convert.ticket_to_pb(self.store.acquire(m.request_id, m.holder))

    def heartbeat(self, m: transfer_pb2.HeartbeatRequest) -> transfer_pb2.HeartbeatReply:
        ticket = self.store.heartbeat(m.request_id, m.holder)
        return transfer_pb2.HeartbeatReply(lease_deadline=ticket.lease_deadline)

    def release(self, m: transfer_pb2.ReleaseRequest) -> transfer_pb2.ReleaseReply:
        mark(TracePoint.RELEASE_RECEIVED, m.request_id)
        self.store.release(m.request_id, m.holder, tuple(m.block_ids), m.slot_id)
        return transfer_pb2.ReleaseReply()

    def abort(self, m: transfer_pb2.AbortRequest) -> transfer_pb2.AbortReply:
        if len(m.reason) > 1024:
            raise InvalidInput("reason: at most 1024 characters")
        self.store.abort(m.request_id, m.reason, m.abort_key)
        return transfer_pb2.AbortReply()

    def stage(self, m: transfer_pb2.StageRequest) -> transfer_pb2.StageReply:
        request = convert.stage_request_from_pb(m)
        self.store.heartbeat(request.request_id, request.holder)  # held by the caller
        if self._stage is None:
            raise CapacityError("staging: this prefill instance has no staging area")
        return transfer_pb2.StageReply(staging_offset=self._stage(request))

    def Handshake(self, request, context):
        return unary(context, self.handshake, request)

    def Acquire(self, request, context):
        return unary(context, self.acquire, request)

    def Heartbeat(self, request, context):
        return unary(context, self.heartbeat, request)

    def Release(self, request, context):
        return unary(context, self.release, request)

    def Abort(self, request, context):
        return unary(context, self.abort, request)

    def Stage(self, request, context):
        return unary(context, self.stage, request)


class PrefillServicer(worker_pb2_grpc.PrefillServiceServicer):
    """Hosts `prefill(PrefillRequest) -> Ticket` (the engine's) as PrefillService."""

    def __init__(
        self,
        prefill: Callable[[PrefillRequest, Callable[[], bool]], Ticket],
        abandon: Callable[[Ticket], None] | None = None,
    ):
        """`prefill(request, is_cancelled)`: is_cancelled() turns true once the caller has
        gone (cancelled, past its deadline), so long work can stop early."""
        self._prefill = prefill
        self._abandon = abandon

    def prefill(self, m, context: grpc.ServicerContext) -> transfer_pb2.Ticket:
        request = convert.prefill_request_from_pb(m)
        mark(TracePoint.PREFILL_RECEIVED, request.request_id)
        ticket = self._prefill(request, lambda: not context.is_active())
        if self._abandon is not None and not context.is_active():
            # The caller gave up (cancelled, past its deadline): nobody will use this ticket.
            self._abandon(ticket)
        mark(TracePoint.PREFILL_ANSWERED, request.request_id)
        return convert.ticket_to_pb(ticket)

    def Prefill(self, request, context):
        return unary(context, lambda m: self.prefill(m, context), request)


class DecodeServicer(worker_pb2_grpc.DecodeServiceServicer):
    """Hosts `decode(DecodeRequest) -> Iterable[TokenEvent]` as DecodeService."""

    def __init__(
        self,
        decode: Callable[[DecodeRequest], Iterable[TokenEvent]],
        register_prefill: Callable[[list[str]], None] | None = None,
        draining: threading.Event | None = None,
        decode_start: StartDecode | None = None,
    ):
        self._decode = decode
        self._decode_start = decode_start
        self._register_prefill = register_prefill
        self._draining = draining if draining is not None else threading.Event()

    def register(self, m: worker_pb2.RegisterPrefillRequest) -> worker_pb2.RegisterPrefillReply:
        if self._register_prefill is None:
            raise WrongState("this decode instance takes prefill peers from --prefill-peers only")
        if len(m.addresses) > MAX_REGISTERED:
            raise InvalidInput(f"addresses: at most {MAX_REGISTERED} per call")
        self._register_prefill(list(m.addresses))
        return worker_pb2.RegisterPrefillReply()

    def RegisterPrefill(self, request, context):
        return unary(context, self.register, request)

    def Decode(self, request, context):
        yield from stream(
            context, lambda m: self._decode(convert.decode_request_from_pb(m)), request
        )

    def DecodeMany(self, request_iterator, context):
        yield from DecodeManyCall(self._decode, self._draining, self._decode_start).serve(
            request_iterator, context
        )


class RouterServicer(worker_pb2_grpc.RouterServiceServicer):
    """Hosts `generate(GenerateRequest) -> AsyncIterator[TokenEvent]` as RouterService, on
    a grpc.aio server."""

    def __init__(self, generate: Callable[[GenerateRequest], AsyncIterator[TokenEvent]]):
        self._generate = generate

    async def Generate(self, request, context):
        try:
            async for event in self._generate(convert.generate_request_from_pb(request)):
                yield convert.token_event_to_pb(event)
        except Exception as exc:  # every failure becomes a status, never a hung call
            await context.abort(*_grpc_status(exc))


def unary(context: grpc.ServicerContext, fn: Callable, request):
    try:
        return fn(request)
    except Exception as exc:  # every failure becomes a status, never a hung call
        _abort(context, exc)


def stream(context: grpc.ServicerContext, fn: Callable, request) -> Iterator[worker_pb2.TokenEvent]:
    try:
        for event in fn(request):
            yield convert.token_event_to_pb(event)
    except Exception as exc:
        _abort(context, exc)


def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
    context.abort(*_grpc_status(exc))


def _grpc_status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    code, details = status_of(exc)
    if code == GrpcCode.INTERNAL:
        logger.exception("control-plane call failed")
    return getattr(grpc.StatusCode, code), details
