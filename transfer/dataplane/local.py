"""In-process transport: memcpy between arenas of one process. For unit tests only.

Peers find each other through a process-wide registry of agent names; the metadata's base
address guards against a stale entry. Every transfer finishes inside `post`.
"""

from __future__ import annotations

import threading
import weakref

import torch

from transfer.dataplane.arena_info import ArenaInfo
from transfer.dataplane.base import TransportBase
from transfer.dataplane.metadata import PeerInfo
from transfer.dataplane.ranges import RangeBatch
from transfer.dataplane.types import DONE, Notification, Op, TransferStatus
from transfer.errors import InvalidInput

_REGISTRY: weakref.WeakValueDictionary[str, LocalTransport] = weakref.WeakValueDictionary()
_REGISTRY_LOCK = threading.Lock()


class LocalTransport(TransportBase):
    backend = "local"

    def __init__(self, agent_name: str) -> None:
        super().__init__(agent_name)
        with _REGISTRY_LOCK:
            if agent_name in _REGISTRY:
                raise InvalidInput(f"agent_name: {agent_name!r} already names a local transport")
            _REGISTRY[agent_name] = self
        self._tensor: torch.Tensor | None = None
        self._inbox: list[Notification] = []
        self._inbox_lock = threading.Lock()

    def _register(self, arena: torch.Tensor, info: ArenaInfo) -> bytes:
        self._tensor = arena
        return b""

    def _add_peer(self, info: PeerInfo) -> None:
        peer = _REGISTRY.get(info.name)
        if peer is None or peer.arena is None or peer.arena.address != info.base_address:
            raise InvalidInput(f"metadata: no live local transport {info.name!r} with that arena")

    def _remove_peer(self, peer: str) -> None:
        pass

    def _post(
        self, op: Op, peer: PeerInfo, ranges: RangeBatch, notif: bytes, deadline_s: float
    ) -> tuple[None, TransferStatus]:
        target = _REGISTRY.get(peer.name)
        if target is None or target._closed or target._tensor is None:
            return None, TransferStatus.failure(f"peer {peer.name!r} is closed")
        local, remote = self._tensor, target._tensor
        src, dst = (remote, local) if op is Op.READ else (local, remote)
        src_off, dst_off = (
            (ranges.remote, ranges.local) if op is Op.READ else (ranges.local, ranges.remote)
        )
        for s, d, n in zip(src_off.tolist(), dst_off.tolist(), ranges.nbytes.tolist(), strict=True):
            dst[d : d + n].copy_(src[s : s + n])
        if notif:
            with target._inbox_lock:
                target._inbox.append(Notification(self.name, notif))
        return None, DONE

    def _check(self, record: None) -> TransferStatus:
        raise AssertionError("local transfers finish inside post")

    def _cancel(self, record: None) -> None:
        pass

    def _abandon(self, record: None) -> None:
        pass

    def _settled(self, record: None) -> bool:
        return True

    def _discard(self, record: None) -> None:
        pass

    def _notifications(self) -> list[Notification]:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        return inbox

    def _close(self) -> None:
        self._tensor = None
        with _REGISTRY_LOCK:
            if _REGISTRY.get(self.name) is self:
                del _REGISTRY[self.name]
