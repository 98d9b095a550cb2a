"""How the HTTP app waits on the engine: its async token stream on the app's event loop
(or a blocking one on a thread), SSE responses that start only once the request is
admitted, and work cancelled when the client goes away.

A request refused at admission (every instance full) must be a 429 before any byte of a
stream is sent, as OpenAI and vLLM clients expect; the first token event is where the
workers have admitted it (prefill done, decode slot taken), so a stream's headers wait
for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from transfer.serving.openai.errors import api_error_of
from transfer.serving.openai.schema import ApiError, Sampling


class Engine(Protocol):
    """What serves the tokens: the router over prefill and decode instances."""

    def generate(self, request_id: str, prompt_ids: list[int], sampling: Sampling) -> Iterator:
        """Yields events with `.token`, `.logprob` (or None) and `.finished`."""

    # Optional, and taken first: `agenerate(...) -> AsyncIterator`, the same events for a
    # coroutine on the app's event loop.

    def is_ready(self) -> bool: ...

    # Optional: `degraded() -> list[str]`, the instances serving but stalled (a TP rank
    # misses its heartbeats), which /health reports.


_DONE = object()


async def engine_tokens(engine: Engine, request_id: str, ids: list[int], sampling: Sampling):
    """The engine's token stream. An engine's `agenerate` runs here; a blocking
    `generate` is consumed on a thread. Closing this async iterator (client gone) closes
    the engine's stream (a blocking one after its next event)."""
    agenerate = getattr(engine, "agenerate", None)
    if agenerate is not None:
        async with contextlib.aclosing(agenerate(request_id, ids, sampling)) as events:
            async for event in events:
                yield event
        return
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancelled = threading.Event()

    def pump() -> None:
        stream = engine.generate(request_id, ids, sampling)
        try:
            for event in stream:
                loop.call_soon_threadsafe(queue.put_nowait, event)
                if cancelled.is_set():
                    break
        except BaseException as exc:  # noqa: BLE001 (handed to the event loop)
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
            loop.call_soon_threadsafe(queue.put_nowait, _DONE)

    threading.Thread(target=pump, name=f"http-{request_id}", daemon=True).start()
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        cancelled.set()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable, on_gone: Callable[[], None]):
    """`work`'s result, or cancel it when the client disconnects first (`on_gone` is
    called, and the ASGI server has no one to answer). Errors become OpenAI errors."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            on_gone()  # after the work's own cleanup: its token stream is closed by now
            raise ApiError(499, "the client closed the request", code="client_closed")
        try:
            return task.result()
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 (turned into the OpenAI error shape)
            raise api_error_of(exc) from exc
    finally:
        watcher.cancel()
        task.cancel()


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


Put = Callable[[dict], Awaitable[None]]
Admit = Callable[[], None]


class _SseResponse(StreamingResponse):
    """Cancels the producer however the response ends, even when the client left before
    the body started (the body iterator's own cleanup never runs then)."""

    def __init__(self, body: AsyncIterator[bytes], producer: asyncio.Task) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._producer = producer

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._producer.cancel()


async def admitted_stream(
    request: Request, run: Callable[[Put, Admit], Awaitable[None]], on_gone: Callable[[], None]
) -> StreamingResponse:
    """SSE from `run(put, admit)`, which awaits `put(payload)` per chunk and calls `admit()`
    once the engine has accepted its request (its first token event). Nothing is sent until
    then: a refusal before it raises here as an `ApiError` (429 for a full pool) instead of
    a 200 and an error event. A client that leaves cancels `run` and its token stream."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    admission: asyncio.Future = loop.create_future()

    def admit() -> None:
        if not admission.done():
            admission.set_result(None)

    async def produce() -> None:
        try:
            await run(queue.put, admit)
        except Exception as exc:  # noqa: BLE001 (before admission: an HTTP error; after: an event)
            error = api_error_of(exc)
            if not admission.done():
                admission.set_exception(error)
                return
            await queue.put(error.body())
        admit()  # a request that ended without a token event (no prompt) was not refused
        await queue.put(None)

    producer = asyncio.create_task(produce())
    try:
        await unless_disconnected(request, asyncio.shield(admission), on_gone)
    except BaseException:
        producer.cancel()
        raise

    async def events():
        while (item := await queue.get()) is not None:
            yield sse(item)
        yield sse("[DONE]")

    return _SseResponse(events(), producer)
