"""The prefill instances a decode instance has handshaken with, and the addresses it may
dial. Shared by the engine thread and the handshake helpers, hence the lock (never held
across a call)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from transfer.cache.layout import Layout
from transfer.control.client import TransferClient
from transfer.control.errors import GrpcCode, NotPermitted
from transfer.errors import PeerUnavailable
from transfer.serving.addresses import resolve


@dataclass(frozen=True)
class Peer:
    """A prefill instance this decode instance has handshaken with."""

    instance_id: str
    address: str
    layouts: tuple[Layout, ...]
    client: TransferClient  # blocking calls (the planner's Stage); the engine uses PeerClient


class PeerTable:
    def __init__(self, known: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self._known: set[str] = set()
        self.register(known)

    def register(self, addresses: Iterable[str]) -> None:
        """Prefill instances (HOST:PORT) this instance may dial."""
        resolved = [ip for address in addresses for ip in resolve(address)]
        with self._lock:
            self._known.update(resolved)

    def check_known(self, address: str) -> None:
        with self._lock:
            known = set(self._known)
        if address in known or known.intersection(resolve(address)):
            return
        raise NotPermitted(
            f"ticket.address: {address!r} is not a known prefill instance "
            "(decode --prefill-peers, or registered by the router)"
        )

    def get(self, address: str, instance_id: str = "") -> Peer | None:
        """The peer at `address`, unless it restarted as another instance (ids carry a boot
        id) or was never handshaken."""
        with self._lock:
            peer = self._peers.get(address)
        if peer is not None and (not instance_id or peer.instance_id == instance_id):
            return peer
        return None

    def add(self, peer: Peer) -> None:
        with self._lock:
            self._peers[peer.address] = peer

    def forget(self, address: str) -> None:
        """Handshake again next time (the peer may have restarted). Requests still using the
        old `Peer` keep its client."""
        with self._lock:
            self._peers.pop(address, None)

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.client.close()


def unreachable(exc: BaseException) -> bool:
    """Whether `exc` says the prefill instance cannot be reached (handshake again)."""
    return isinstance(exc, PeerUnavailable) or getattr(exc, "code", "") == GrpcCode.UNAVAILABLE
