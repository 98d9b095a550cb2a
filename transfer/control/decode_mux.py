"""The client half of DecodeMany: every decode a client starts on one instance shares one
call, opened on the first and opened again after a failure.

One reader thread takes each `DecodeEvents` message apart into the inboxes of the decodes
it names; `decode` reads its own inbox. A decode whose caller stops early is cancelled on
the call, which frees its slot and blocks on the instance within a step.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from transfer.control import convert
from transfer.control.errors import ControlError, GrpcCode, control_error_of
from transfer.control.gen import worker_pb2
from transfer.control.types import DecodeRequest, TokenEvent

_CLOSE = object()

# (outgoing DecodeCall messages) -> the call's DecodeEvents messages (a grpc call object)
OpenCall = Callable[[Iterator[worker_pb2.DecodeCall]], Iterator[worker_pb2.DecodeEvents]]


@dataclass(eq=False)
class _Session:
    """One DecodeMany call and the decodes waiting on it."""

    outgoing: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    inboxes: dict[int, queue.SimpleQueue] = field(default_factory=dict)
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
        ended = False
        try:
            while True:
                item = inbox.get()
                if isinstance(item, ControlError):
                    ended = True
                    raise item
                if item.HasField("end"):
                    ended = True
                    if item.end.code:
                        raise ControlError(item.end.code, item.end.details)
                    return
                yield convert.token_event_from_pb(item.token)
        finally:
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
                with self._lock:
                    inboxes = [(session.inboxes.get(e.stream_id), e) for e in message.events]
                for inbox, event in inboxes:
                    if inbox is not None:  # None: its caller already left
                        inbox.put(event)
        except grpc.RpcError as err:
            ended = control_error_of(err)
        with self._lock:
            if self._session is session:
                self._session = None  # the next decode opens a new call
            waiting = list(session.inboxes.values())
            session.inboxes.clear()
        session.outgoing.put(_CLOSE)
        for inbox in waiting:
            inbox.put(ended)
