"""The front door: `Generate` = Prefill on one prefill instance, then Decode on a decode instance.

Each request goes to the prefill and the decode instance that hold the longest cached
prefix of its prompt (`prefix_routes`), among those not much busier than the rest; without
such a hint, in turn. A prefill that fails for a reason another instance might not share
(unreachable, deadline, internal error, pool full) is retried on the next instance; bad
input is not. A request
the router drops after prefill is Aborted at its prefill instance, so the cache is freed
at once rather than when the lease runs out.

A request runs as a coroutine on its front end's event loop (the gRPC server's, or the
HTTP server's); its tokens arrive there a decode step at a time, and only the blocking
unary calls take one of the router's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from transfer.cache.block_hashes import block_hashes
from transfer.control.client import ClientOptions, DecodeClient, PrefillClient, TransferClient
from transfer.control.errors import ControlError, GrpcCode
from transfer.control.types import (
    DecodeRequest,
    GenerateRequest,
    PrefillRequest,
    SamplingParams,
    Ticket,
    TokenEvent,
)
from transfer.serving.addresses import UNSPECIFIED_HOSTS, split_address
from transfer.serving.openai.instance_pool import InstancePool, any_serving, by_prefix, stalled
from transfer.serving.openai.introductions import Introductions
from transfer.serving.openai.metrics import RouterMetrics
from transfer.serving.openai.prefix_routes import PrefixRoutes, learn_block_size
from transfer.serving.role import INSTANCE_ROLES, ServeRole
from transfer.trace import TracePoint, mark

logger = logging.getLogger(__name__)

# A prefill failing with these may succeed on another instance. A prefill that timed out
# may still publish; the prefill instance frees a ticket whose caller has gone.
RETRY_CODES = frozenset(
    {GrpcCode.UNAVAILABLE, GrpcCode.DEADLINE_EXCEEDED, GrpcCode.RESOURCE_EXHAUSTED}
)
# A decode failing with these before its first token is run again (prefill included).
# PERMISSION_DENIED: a restarted decode instance that no longer knows the prefill.
DECODE_RETRY_CODES = frozenset({GrpcCode.UNAVAILABLE, GrpcCode.ABORTED, GrpcCode.PERMISSION_DENIED})
DECODE_ATTEMPTS = 2
HEALTH_TIMEOUT_S = 2.0
ROUTER_THREADS = 64


class Router:
    """Routes `Generate` over `prefill` and `decode` instance addresses."""

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        options: ClientOptions | None = None,
        metrics: RouterMetrics | None = None,
        threads: int = ROUTER_THREADS,
    ) -> None:
        """`threads` bounds the blocking calls (Prefill, Abort, RegisterPrefill) in flight;
        more wait their turn."""
        if not prefill:
            raise ValueError("prefill: the router needs at least one --prefill HOST:PORT")
        if not decode:
            raise ValueError("decode: the router needs at least one --decode HOST:PORT")
        for address in (*prefill, *decode):
            split_address(address)
        self.options = options or ClientOptions()
        self.metrics = metrics or RouterMetrics()
        self._prefill = InstancePool(prefill, lambda t, a: PrefillClient(t, **self._kwargs(a)))
        self._decode = InstancePool(decode, lambda t, a: DecodeClient(t, **self._kwargs(a)))
        self._routes = {role: PrefixRoutes() for role in INSTANCE_ROLES}
        self._block_size = 0  # learned from the first ticket whose hashes say it
        self._transfer_lock = threading.Lock()
        self._transfer_clients: dict[str, TransferClient] = {}
        self._introductions = Introductions()
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="router")
        self._loop: asyncio.AbstractEventLoop | None = None  # `generate`'s, started on first use
        health = {"timeout_s": HEALTH_TIMEOUT_S}
        self._health = {
            ServeRole.PREFILL: InstancePool(
                prefill, lambda t, a: TransferClient(t, **self._kwargs(a, **health))
            ),
            ServeRole.DECODE: InstancePool(
                decode, lambda t, a: DecodeClient(t, **self._kwargs(a, **health))
            ),
        }

    def _kwargs(self, original: str, timeout_s: float | None = None) -> dict:
        tls = self.options.tls
        if tls is not None and not tls.server_name:
            # Connecting by resolved IP: check the certificate against the name we were given.
            tls = replace(tls, server_name=split_address(original)[0])
        timeout = self.options.timeout_s if timeout_s is None else timeout_s
        return {"token": self.options.token, "tls": tls, "timeout_s": timeout}

    async def agenerate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens; the first event's `ttft_ms` is measured here. A decode
        that fails before the first token, for a reason a retry may not share (its transfer
        failed, an instance went away), is run once more from prefill on the next instances.
        Runs on the caller's event loop; the blocking calls go to the router's threads."""
        start = time.perf_counter()
        mark(TracePoint.ROUTER_RECEIVED, request.request_id)
        status = "failed"
        if request.sampling.seed is None and not request.sampling.greedy:
            # One seed for both sides, so the request's tokens are one stream.
            seeded = replace(request.sampling, seed=secrets.randbits(63))
            request = replace(request, sampling=seeded)
        try:
            for attempt in range(DECODE_ATTEMPTS):
                first = True
                try:
                    async for event in self._attempt(request):
                        if first:
                            event = replace(event, ttft_ms=(time.perf_counter() - start) * 1e3)
                            mark(TracePoint.ROUTER_FIRST_TOKEN, request.request_id)
                            first = False
                        yield event
                    break
                except ControlError as exc:
                    last = attempt + 1 == DECODE_ATTEMPTS
                    if not first or exc.code not in DECODE_RETRY_CODES or last:
                        raise
                    logger.warning("request %r failed before its first token (%s); retrying",
                                   request.request_id, exc)  # fmt: skip
                    self.metrics.decode_retries.inc()
                    self._decode.forget()
            status = "ok"
        except (GeneratorExit, asyncio.CancelledError):
            # The caller stopped reading (EOS, a stop string, a client gone): nothing failed.
            status = "ok"
            raise
        finally:
            self.metrics.requests.labels(status=status).inc()

    def generate(self, request: GenerateRequest) -> Iterator[TokenEvent]:
        """`agenerate` for a thread: each event is awaited on the router's own event loop."""
        loop = self._own_loop()
        events = self.agenerate(request)
        try:
            while True:
                try:
                    yield asyncio.run_coroutine_threadsafe(anext(events), loop).result()
                except StopAsyncIteration:
                    return
        finally:
            asyncio.run_coroutine_threadsafe(events.aclose(), loop).result()

    async def _attempt(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        ticket, prefill_at = await self._prefill_on_thread(request)
        if ticket.address.rpartition(":")[0] in UNSPECIFIED_HOSTS:
            ticket = replace(ticket, address=prefill_at)
        first = True
        try:
            async for event in self._run_decode(ticket, request.max_tokens, request.sampling):
                first = False
                yield event
        finally:
            if first:
                # Nothing reached the caller: free the prefill cache now, not at lease end.
                self._abort_soon(ticket, "router dropped the request")

    async def _prefill_on_thread(self, request: GenerateRequest) -> tuple[Ticket, str]:
        """`_run_prefill` on a router thread. A caller cancelled meanwhile still gets its
        ticket Aborted once the prefill returns."""
        running = asyncio.wrap_future(self._threads.submit(self._run_prefill, request))
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            running.add_done_callback(self._abort_unclaimed)
            raise

    def _abort_unclaimed(self, prefill: asyncio.Future) -> None:
        if not prefill.cancelled() and prefill.exception() is None:
            ticket, _ = prefill.result()
            self._abort_soon(ticket, "caller gone before its first token")

    def _abort_soon(self, ticket: Ticket, reason: str) -> None:
        with contextlib.suppress(RuntimeError):  # the router is closing: the lease frees it
            self._threads.submit(self._abort, ticket, reason)

    def is_ready(self) -> bool:
        """Whether at least one prefill and one decode instance answer health SERVING."""
        return all(any_serving(pool) for pool in self._health.values())

    def degraded(self) -> list[str]:
        """The instances ("prefill HOST:PORT", "decode HOST:PORT") that say a TP rank of
        theirs misses its heartbeats: still serving, but stalled while it lasts."""
        return stalled(self._health)

    def _run_prefill(self, request: GenerateRequest):
        prefill = PrefillRequest(
            request.request_id, request.prompt_ids, request.max_tokens, request.sampling
        )
        last: ControlError | None = None
        routes = self._routes[ServeRole.PREFILL]
        size = self._block_size
        hashes = block_hashes(request.prompt_ids, size) if size else ()
        ordered = self._prefill.up_first(by_prefix(self._prefill.order(), routes, hashes))
        for target, client in ordered:
            routes.started(target)
            try:
                ticket = client.prefill(prefill)
                mark(TracePoint.ROUTER_PREFILL_ANSWERED, request.request_id)
                self._learn(request.prompt_ids, ticket)
                routes.record(target, ticket.block_hashes)
                return ticket, target
            except ControlError as exc:
                if exc.code not in RETRY_CODES:
                    raise  # the caller's input, or a limit it can never fit: no retry helps
                last = exc
                logger.warning(
                    "prefill of %r failed on %s (%s); trying another instance",
                    request.request_id,
                    target,
                    exc,
                )
                self.metrics.prefill_retries.inc()
                if exc.code == GrpcCode.UNAVAILABLE:
                    self._prefill.mark_down(target)
                if exc.code != GrpcCode.RESOURCE_EXHAUSTED:
                    self._prefill.forget()
            finally:
                routes.finished(target)
        if last is None:
            raise ControlError(GrpcCode.UNAVAILABLE, "no prefill instance resolved")
        raise last  # every instance failed: the last one's code (RESOURCE_EXHAUSTED if all full)

    async def _run_decode(
        self, ticket, max_tokens: int, sampling: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        routes = self._routes[ServeRole.DECODE]
        ordered = by_prefix(self._decode.order(), routes, ticket.block_hashes)
        targets = self._decode.up_first(ordered)
        if not targets:
            raise ControlError(GrpcCode.UNAVAILABLE, "no decode instance resolved")
        target, client = targets[0]
        routes.started(target)
        try:
            introductions = self._introductions
            if not introductions.known(target, ticket.address):
                await asyncio.wrap_future(
                    self._threads.submit(introductions.register, target, client, ticket.address)
                )
            async for event in client.adecode(DecodeRequest(ticket, max_tokens, sampling)):
                yield event
            routes.record(target, ticket.block_hashes)
        except ControlError as exc:
            self._introductions.forget(target, ticket.address)
            if exc.code == GrpcCode.UNAVAILABLE:
                self._decode.mark_down(target)
            raise
        finally:
            routes.finished(target)

    def _learn(self, prompt: Sequence[int], ticket: Ticket) -> None:
        if not self._block_size:
            self._block_size = learn_block_size(prompt, ticket.block_hashes, len(ticket.block_ids))

    def introduce(self) -> threading.Thread:
        """Register every prefill instance with every decode instance now, in the background
        (`Introductions.introduce`)."""
        return self._introductions.introduce(self._prefill, self._decode)

    def _abort(self, ticket: Ticket, reason: str) -> None:
        """Best effort: a dead prefill instance has freed everything anyway."""
        address, request_id = ticket.address, ticket.request_id
        try:
            with self._transfer_lock:
                client = self._transfer_clients.get(address)
                if client is None:
                    client = TransferClient(address, **self._kwargs(address, timeout_s=5.0))
                    self._transfer_clients[address] = client
            client.abort(request_id, ticket.abort_key, reason)
        except (ControlError, ValueError) as exc:
            logger.info("abort of %r at %s: %s", request_id, address, exc)

    def _own_loop(self) -> asyncio.AbstractEventLoop:
        with self._transfer_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="router-loop",
                                 daemon=True).start()  # fmt: skip
            return self._loop

    def close(self) -> None:
        self._introductions.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
        with self._transfer_lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        self._prefill.close()
        self._decode.close()
        for pool in self._health.values():
            pool.close()
        with self._transfer_lock:
            for client in self._transfer_clients.values():
                client.close()
            self._transfer_clients.clear()
