"""The client half of DecodeMany: every decode a client starts on one instance shares one
call, opened on the first and opened again after a failure.

One reader thread takes each `DecodeEvents` message apart into the inboxes of the decodes
it names; `decode` (a thread) or `adecode` (a coroutine) reads its own inbox. A message's
events for coroutines on one event loop cross to that loop in one hand-off, so a step of
32 tokens wakes the loop once, not 32 threads. A decode whose caller stops early is
cancelled on the call, which frees its slot and blocks on the instance within a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import grpc

from transfer.control import convert
from transfer.control.errors import ControlError, GrpcCode, control_error_of
from transfer.control.gen import worker_pb2
from transfer.control.types import DecodeRequest, TokenEvent
from transfer.trace import TracePoint, enabled, mark

_CLOSE = object()

# (outgoing DecodeCall messages) -> the call's DecodeEvents messages (a grpc call object)
OpenCall = Callable[[Iterator[worker_pb2.DecodeCall]], Iterator[worker_pb2.DecodeEvents]]


@dataclass(frozen=True, eq=False)
class _LoopInbox:
    """A coroutine's inbox: a queue that only its event loop touches."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


Inbox = queue.SimpleQueue | _LoopInbox


@dataclass(eq=False)
class _Session:
    """One DecodeMany call and the decodes waiting on it."""

    outgoing: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    inboxes: dict[int, Inbox] = field(default_factory=dict)
    call: object = None

    def messages(self) -> Iterator[worker_pb2.DecodeCall]:
        return iter(self.outgoing.get, _CLOSE)


class DecodeMux:
    """`decode(request)` as a Decode call would give it, over one shared DecodeMany call."""

    def __init__(self, open_call: OpenCall) -> None:
        self._open_call = open_call
        self._lock = threading.Lock()
        self._session: _Session | None = None
        self._stream_ids = itertools.count(1)
        self._closed = False

    def decode(self, request: DecodeRequest) -> Iterator[TokenEvent]:
        """The request's events; raises ControlError with the code the decode (or the call)
        failed with."""
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        with self._stream(request, inbox):
            while (event := _event_of(inbox.get())) is not None:
                yield event

    async def adecode(self, request: DecodeRequest) -> AsyncIterator[TokenEvent]:
        """`decode` for a coroutine on the running event loop."""
        inbox = _LoopInbox(asyncio.get_running_loop(), asyncio.Queue())
        with self._stream(request, inbox):
            while (event := _event_of(await inbox.queue.get())) is not None:
                yield event

    @contextlib.contextmanager
    def _stream(self, request: DecodeRequest, inbox: Inbox) -> Iterator[None]:
        """The decode's stream on the call, delivering to `inbox`, for the block's life. A
        block left before the decode ended (its caller stopped) cancels it on the call."""
        session, stream_id = self._start(request, inbox)
        ended = False
        try:
            yield
            ended = True
        except ControlError:  # the decode (or the call) failed: it has ended
            ended = True
            raise
        finally:
            self._leave(session, stream_id, ended)

    def _start(self, request: DecodeRequest, inbox: Inbox) -> tuple[_Session, int]:
        with self._lock:
            if self._closed:
                raise ControlError(GrpcCode.CANCELLED, "the decode client is closed")
            session = self._session if self._session is not None else self._open()
            stream_id = next(self._stream_ids)
            session.inboxes[stream_id] = inbox
        start = worker_pb2.DecodeCall(
            stream_id=stream_id, start=convert.decode_request_to_pb(request)
        )
        session.outgoing.put(start)
        return session, stream_id

    def _leave(self, session: _Session, stream_id: int, ended: bool) -> None:
        with self._lock:
            session.inboxes.pop(stream_id, None)
        if not ended:
            session.outgoing.put(worker_pb2.DecodeCall(stream_id=stream_id, cancel=True))

    def close(self) -> None:
        """Cancel the call: decodes still running fail with CANCELLED."""
        with self._lock:
            self._closed = True
            session, self._session = self._session, None
        if session is not None:
            session.outgoing.put(_CLOSE)
            session.call.cancel()

    def _open(self) -> _Session:
        session = _Session()
        session.call = self._open_call(session.messages())
        self._session = session
        threading.Thread(target=self._read, args=(session,), name="decode-mux-reader",
                         daemon=True).start()  # fmt: skip
        return session

    def _read(self, session: _Session) -> None:
        ended = ControlError(GrpcCode.UNAVAILABLE, "the DecodeMany call ended")
        try:
            for message in session.call:
                if enabled():
                    _mark_first_tokens(message)
                with self._lock:
                    inboxes = [(session.inboxes.get(e.stream_id), e) for e in message.events]
                _deliver(inboxes)
        except grpc.RpcError as err:
            ended = control_error_of(err)
        with self._lock:
            if self._session is session:
                self._session = None  # the next decode opens a new call
            waiting = list(session.inboxes.values())
            session.inboxes.clear()
        session.outgoing.put(_CLOSE)
        _deliver([(inbox, ended) for inbox in waiting])


def _mark_first_tokens(message: worker_pb2.DecodeEvents) -> None:
    for event in message.events:
        if event.HasField("token") and event.token.index == 0:
            mark(TracePoint.ROUTER_TOKEN_READ, event.token.request_id)


def _event_of(item: worker_pb2.DecodeEvent | ControlError) -> TokenEvent | None:
    """The token an inbox item carries; None at the decode's clean end."""
    if isinstance(item, ControlError):
        raise item
    if item.HasField("end"):
        if item.end.code:
            raise ControlError(item.end.code, item.end.details)
        return None
    return convert.token_event_from_pb(item.token)


def _deliver(items: list[tuple[Inbox | None, object]]) -> None:
    """Put each item in its inbox (None: its caller already left); items bound for one
    event loop go over in one call."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for inbox, item in items:
        if isinstance(inbox, _LoopInbox):
            by_loop.setdefault(inbox.loop, []).append((inbox.queue, item))
        elif inbox is not None:
            inbox.put(item)
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to read
            loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for inbox, item in batch:
        inbox.put_nowait(item)
