"""The server half of DecodeMany: many decodes over one call.

With a `start` (an engine that takes requests and hands their events over itself), a
started decode is only submitted: the engine hands each step's events of this call over
in one batch, which the response stream sends as one `DecodeEvents`, so a step of N
requests costs one message and no thread per decode. Without one, each decode runs
`decode(request)` on a thread of its own, exactly as a Decode call would, and the
response stream sends whatever the outbox holds as one message (docs/benchmarks.md, "One
message per step").
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from transfer.control import convert
from transfer.control.errors import GrpcCode, status_of
from transfer.control.gen import worker_pb2
from transfer.control.types import DecodeRequest, TokenEvent

logger = logging.getLogger(__name__)

_END_OF_CALL = object()

# What an engine hands a sink: (the tag given to `start`, a TokenEvent, or the exception that
# ended the decode, or None when it ended well), one step's worth at a time.
SinkItems = list[tuple[Any, Any]]
# start(request, sink, tag) -> cancel: submit `request`; the engine calls `sink` with its
# events from the engine's thread; `cancel()` ends it early.
StartDecode = Callable[[DecodeRequest, Callable[[SinkItems], None], Any], Callable[[], None]]


class DecodeManyCall:
    """Serves one DecodeMany call with `decode`."""

    def __init__(
        self,
        decode: Callable[[DecodeRequest], Iterable[TokenEvent]],
        draining: threading.Event,
        start: StartDecode | None = None,
    ) -> None:
        """`draining` set: the server is stopping, so decodes started now end UNAVAILABLE at
        once (as a new Decode call would), and the caller tries another instance."""
        self._decode = decode
        self._start_decode = start
        self._draining = draining
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # events, or lists of them
        self._lock = threading.Lock()
        self._running: dict[int, threading.Event] = {}  # stream id -> its cancel flag
        self._cancels: dict[int, Callable[[], None]] = {}  # stream id -> an engine's cancel
        self._caller_done = False  # the caller sent its last DecodeCall

    def serve(
        self, calls: Iterator[worker_pb2.DecodeCall], context: grpc.ServicerContext
    ) -> Iterator[worker_pb2.DecodeEvents]:
        """The response stream: ends once the caller has half-closed and every decode it
        started has ended, or when the call is cancelled (then every decode stops)."""
        context.add_callback(self._cancel_all)
        threading.Thread(target=self._read, args=(calls,), name="decode-many-reader",
                         daemon=True).start()  # fmt: skip
        while True:
            items = [self._outbox.get()]
            while True:
                try:
                    items.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            events = [e for item in items for e in (item if isinstance(item, list) else [item])]
            last = events[-1] is _END_OF_CALL
            events = [e for e in events if e is not _END_OF_CALL]
            if events:
                yield worker_pb2.DecodeEvents(events=events)
            if last:
                return

    def _read(self, calls: Iterator[worker_pb2.DecodeCall]) -> None:
        try:
            for call in calls:
                if call.HasField("start"):
                    self._start(call.stream_id, call.start)
                elif call.cancel:
                    self._cancel(call.stream_id)
        except grpc.RpcError:
            pass  # the call ended under the reader: _cancel_all runs
        except Exception:  # noqa: BLE001 - a bad message must not leave decodes running
            logger.exception("DecodeMany: reading the caller's messages failed")
            self._cancel_all()
        with self._lock:
            self._caller_done = True
            if not self._running:
                self._outbox.put(_END_OF_CALL)

    def _start(self, stream_id: int, request: worker_pb2.DecodeRequest) -> None:
        cancelled = threading.Event()
        with self._lock:
            if stream_id in self._running:
                refusal = worker_pb2.DecodeEnd(
                    code=GrpcCode.INVALID_ARGUMENT,
                    details=f"stream_id: {stream_id} names a decode that is still running",
                )
            elif self._draining.is_set():
                refusal = worker_pb2.DecodeEnd(
                    code=GrpcCode.UNAVAILABLE, details="the decode instance is shutting down"
                )
            else:
                refusal = None
                self._running[stream_id] = cancelled
        if refusal is not None:
            self._outbox.put(worker_pb2.DecodeEvent(stream_id=stream_id, end=refusal))
            return
        if self._start_decode is not None:
            try:
                cancel = self._start_decode(
                    convert.decode_request_from_pb(request), self._take, stream_id
                )
            except Exception as exc:  # bad input, or the engine is closed
                self._take([(stream_id, exc)])
                return
            with self._lock:
                if stream_id in self._running:  # not ended already
                    self._cancels[stream_id] = cancel
                    if cancelled.is_set():
                        cancel()
            return
        threading.Thread(target=self._run, args=(stream_id, request, cancelled),
                         name=f"decode-many-{stream_id}", daemon=True).start()  # fmt: skip

    def _run(
        self, stream_id: int, request: worker_pb2.DecodeRequest, cancelled: threading.Event
    ) -> None:
        end = worker_pb2.DecodeEnd()
        events = None
        try:
            events = iter(self._decode(convert.decode_request_from_pb(request)))
            for event in events:
                token = convert.token_event_to_pb(event)
                self._outbox.put(worker_pb2.DecodeEvent(stream_id=stream_id, token=token))
                if cancelled.is_set():
                    end = worker_pb2.DecodeEnd(
                        code=GrpcCode.CANCELLED, details="the caller cancelled"
                    )
                    break
        except Exception as exc:  # every failure ends its own decode, never the call
            end = _end_of(exc)
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()  # a generator's cleanup (the decode frees its slot) runs here
        self._outbox.put(worker_pb2.DecodeEvent(stream_id=stream_id, end=end))
        with self._lock:
            del self._running[stream_id]
            if self._caller_done and not self._running:
                self._outbox.put(_END_OF_CALL)

    def _take(self, items: SinkItems) -> None:
        """An engine's events for this call (one step's): sent as one message."""
        events, ended = [], []
        for stream_id, item in items:
            if isinstance(item, TokenEvent):
                token = convert.token_event_to_pb(item)
                events.append(worker_pb2.DecodeEvent(stream_id=stream_id, token=token))
                continue
            end = worker_pb2.DecodeEnd() if item is None else _end_of(item)
            events.append(worker_pb2.DecodeEvent(stream_id=stream_id, end=end))
            ended.append(stream_id)
        self._outbox.put(events)
        with self._lock:
            for stream_id in ended:
                self._running.pop(stream_id, None)
                self._cancels.pop(stream_id, None)
            if ended and self._caller_done and not self._running:
                self._outbox.put(_END_OF_CALL)

    def _cancel(self, stream_id: int) -> None:
        with self._lock:
            cancelled = self._running.get(stream_id)
            cancel = self._cancels.get(stream_id)
        if cancelled is not None:
            cancelled.set()
        if cancel is not None:
            cancel()

    def _cancel_all(self) -> None:
        with self._lock:
            flags = list(self._running.values())
            cancels = list(self._cancels.values())
        for cancelled in flags:
            cancelled.set()
        for cancel in cancels:
            cancel()


def _end_of(exc: Exception) -> worker_pb2.DecodeEnd:
    code, details = status_of(exc)
    if code == GrpcCode.INTERNAL:
        logger.exception("DecodeMany: a decode failed")
    return worker_pb2.DecodeEnd(code=code, details=details)
