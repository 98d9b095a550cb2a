"""Decode instance: the gRPC-facing side of the decode engine.

`DecodeWorker.decode` only submits the request to the instance's one engine loop
(`transfer.serving.engine.decode_engine`) and drains the request's queue; the engine pulls
the ticket's cache from its prefill instance and decodes it in shared steps. Any failure
Aborts the ticket and frees everything taken here, once no READ can still land.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from transfer.control.client import ClientOptions
from transfer.control.errors import ControlError, GrpcCode
from transfer.control.metrics import WorkerMetrics
from transfer.control.types import DecodeRequest, TokenEvent
from transfer.serving.engine.decode_engine import DecodeEngine
from transfer.serving.engine.instance import Instance
from transfer.serving.engine.peers import Peer
from transfer.serving.engine.request import END

logger = logging.getLogger(__name__)

# `peer` waits this long for the engine's handshake: its Handshake call has a deadline of its
# own (decode_handshakes.HANDSHAKE_TIMEOUT_S); this bounds the AddPeers after it as well.
PEER_WAIT_S = 120.0
RELEASE_WAIT_S = 60.0  # a leaving consumer waits this long for its cache to go back

__all__ = ["DecodeWorker", "Peer"]


class DecodeWorker:
    """Serves `Decode` for one decode instance."""

    def __init__(
        self,
        instance: Instance,
        instance_id: str,
        options: ClientOptions | None = None,
        metrics: WorkerMetrics | None = None,
        transfer_deadline_s: float = 60.0,
        known_prefill: Iterable[str] = (),
    ) -> None:
        known_prefill = tuple(known_prefill)
        self.instance = instance
        self.instance_id = instance_id
        self.options = options or ClientOptions(timeout_s=30.0)
        self.metrics = metrics
        self.engine = DecodeEngine(
            instance, instance_id, self.options, metrics, transfer_deadline_s, known_prefill
        )
        self.peers = self.engine.setup.peers
        self._prewarm(known_prefill)
        if metrics is not None:
            cache = self.engine.cache
            metrics.track_requests(
                running=lambda: self.engine.num_running, waiting=lambda: len(cache.waiting)
            )
            staging = instance.staging
            metrics.track_staging(free=lambda: staging.free_bytes, total=staging.capacity_bytes)

    @property
    def transfer_deadline_s(self) -> float:
        return self.engine.transfer_deadline_s

    @transfer_deadline_s.setter
    def transfer_deadline_s(self, seconds: float) -> None:
        self.engine.transfer_deadline_s = seconds

    @property
    def heartbeat_s(self) -> float | None:
        """How often a transfer renews its lease (None: a third of the lease)."""
        return self.engine.heartbeat_s

    @heartbeat_s.setter
    def heartbeat_s(self, seconds: float | None) -> None:
        self.engine.heartbeat_s = seconds

    # -- handshake ------------------------------------------------------------------------

    def register_prefill(self, addresses: Iterable[str]) -> None:
        """Prefill instances (HOST:PORT) this instance may dial, besides `known_prefill`;
        the engine handshakes with them now, before their first ticket."""
        addresses = tuple(addresses)
        self.peers.register(addresses)
        self._prewarm(addresses)

    def _prewarm(self, addresses: Iterable[str]) -> None:
        handshakes = self.engine.setup.handshakes
        for address in addresses:
            self.engine.call_soon(lambda a=address: handshakes.prewarm(a))

    def peer(self, address: str, instance_id: str = "") -> Peer:
        """The handshaken prefill instance at `address`, waiting for the engine's handshake
        with it (started now if none is in flight). For callers that drive the ranks by
        hand; once this returns, no AddPeers for `address` is left at the ranks."""
        self.peers.check_known(address)
        peer = self.peers.get(address, instance_id)
        if peer is not None:
            return peer
        handshakes, done = self.engine.setup.handshakes, Future()
        self.engine.call_soon(lambda: handshakes.when_handshaken(address, instance_id, done))
        try:
            return done.result(PEER_WAIT_S)
        except FutureTimeout:
            raise ControlError(
                GrpcCode.DEADLINE_EXCEEDED,
                f"handshake with {address}: not done within {PEER_WAIT_S:g}s",
            ) from None

    def forget(self, address: str) -> None:
        """Handshake again next time (the peer may have restarted)."""
        self.peers.forget(address)

    # -- decode ---------------------------------------------------------------------------

    def decode(self, request: DecodeRequest) -> Iterator[TokenEvent]:
        """Transfer the ticket's cache, then stream `max_tokens` tokens (the ticket's first
        token is event 0; it carries the timings and transfer figures). Closing the stream
        early ends the request; once closed, no step touches its cache."""
        submitted = self.engine.submit(request)
        ended = False
        try:
            while True:
                item = submitted.out.get()
                if item is END:
                    ended = True
                    return
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                yield item
                self.engine.consumer_ready(submitted)
        finally:
            if not ended:
                self.engine.cancel(submitted)
                if not submitted.released.wait(RELEASE_WAIT_S):
                    logger.warning("request %r: its cache was not back within %gs",
                                   submitted.request_id, RELEASE_WAIT_S)  # fmt: skip

    def start_decode(self, request: DecodeRequest, sink, tag) -> Callable[[], None]:
        """DecodeMany's way in: the engine hands `sink` each step's events of every request
        started with it, `[(tag, TokenEvent | exception | None at the end)]`, in one call.
        Returns the request's cancel."""
        submitted = self.engine.submit(request, sink, tag)
        return lambda: self.engine.cancel(submitted)

    def held_requests(self) -> list[str]:
        """Requests whose cache is held until their failed READs settle."""
        return self.engine.held_requests()

    def close(self) -> None:
        self.engine.close()
