"""`TransportBase`: the bookkeeping every backend of the `Transport` protocol shares
(validation, peers, handles and deadlines). The protocol, and what a transfer's states
mean, are in transport.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from transfer.dataplane.arena_info import ArenaInfo, arena_info, check_agent_name
from transfer.dataplane.metadata import PeerInfo
from transfer.dataplane.ranges import RangeBatch
from transfer.dataplane.regions import RegionMap
from transfer.dataplane.types import Notification, Op, TransferStatus
from transfer.errors import Closed, InvalidInput, NotFound, WrongState

MAX_NOTIF_BYTES = 4096
UNSETTLED = "; its bytes may still move until the peer answers or is gone (settled=False)"


@dataclass
class _Entry:
    record: Any  # the backend's own state of one transfer
    peer: str
    deadline: float  # time.monotonic()
    deadline_s: float
    status: TransferStatus


class TransportBase:
    """Validation, peers, handles and deadlines; backends fill in the `_` hooks."""

    backend: ClassVar[str]

    def __init__(self, agent_name: str) -> None:
        self.name = check_agent_name(agent_name)
        self.arena: ArenaInfo | None = None
        self.region_map: RegionMap | None = None  # set by register_regions
        self.peers: dict[str, PeerInfo] = {}
        self._entries: dict[int, _Entry] = {}
        self._draining: list[Any] = []  # released records that may still move bytes
        self._next_handle = 1
        self._closed = False

    # -- public API -------------------------------------------------------------------

    def register(self, arena: torch.Tensor) -> bytes:
        self._check_open()
        if self.arena is not None:
            raise WrongState("arena: already registered (one arena per transport)")
        info = arena_info(arena)
        payload = self._register(arena, info)
        self.arena = info
        return PeerInfo(
            self.backend,
            self.name,
            info.nbytes,
            info.device,
            info.device_index,
            info.address,
            payload,
        ).encode()

    def register_regions(self, regions: Sequence[torch.Tensor]) -> bytes:
        self._check_open()
        if self.arena is not None:
            raise WrongState("arena: already registered (one arena per transport)")
        if not isinstance(regions, Sequence) or not regions:
            raise InvalidInput("regions: expected a non-empty sequence of tensors")
        infos = [arena_info(region) for region in regions]
        for i, info in enumerate(infos):
            if (info.device, info.device_index) != (infos[0].device, infos[0].device_index):
                raise InvalidInput(f"regions[{i}]: on {info.device}, not {infos[0].device}")
        region_map = RegionMap.place([(info.address, info.nbytes) for info in infos])
        payload = self._register_regions(list(regions), region_map)
        self.arena = ArenaInfo(0, region_map.extent, infos[0].device, infos[0].device_index)
        self.region_map = region_map
        return PeerInfo(
            self.backend,
            self.name,
            region_map.extent,
            infos[0].device,
            infos[0].device_index,
            0,
            payload,
            tuple(tuple(r) for r in region_map.to_list()),
        ).encode()

    def add_peer(self, metadata: bytes) -> str:
        self._check_open()
        info = PeerInfo.decode(metadata)
        if info.backend != self.backend:
            raise InvalidInput(
                f"metadata: made by backend {info.backend!r}, this transport is {self.backend!r}"
            )
        if info.name == self.name:
            raise InvalidInput(f"metadata: describes this transport itself ({self.name!r})")
        if info.name in self.peers:
            self.remove_peer(info.name)
        self._add_peer(info)
        self.peers[info.name] = info
        return info.name

    def remove_peer(self, peer: str) -> None:
        self._check_open()
        self._peer(peer)
        for entry in self._entries.values():
            if entry.peer == peer and entry.status.pending:
                self._stop(entry, f"peer {peer!r} removed")
        self._remove_peer(peer)
        del self.peers[peer]

    def post(
        self, op: Op, peer: str, ranges: RangeBatch, notif: bytes = b"", *, deadline_s: float
    ) -> int:
        self._check_open()
        if not isinstance(op, Op):
            raise InvalidInput(f"op: expected Op.READ or Op.WRITE, got {op!r}")
        info = self._peer(peer)
        if not isinstance(ranges, RangeBatch):
            raise InvalidInput(f"ranges: expected a RangeBatch, got {type(ranges).__name__}")
        if self.arena is None:
            raise WrongState("arena: register an arena before posting transfers")
        ranges.check_within(self.arena.nbytes, info.arena_bytes)
        if self.region_map is not None:
            self.region_map.indices(ranges.local, ranges.nbytes, "ranges.local")
        peer_regions = info.region_map()
        if peer_regions is not None:
            peer_regions.indices(ranges.remote, ranges.nbytes, "ranges.remote")
        if not isinstance(notif, bytes) or len(notif) > MAX_NOTIF_BYTES:
            raise InvalidInput(f"notif: expected bytes of at most {MAX_NOTIF_BYTES} bytes")
        if not isinstance(deadline_s, int | float) or not (0 < deadline_s < math.inf):
            raise InvalidInput(
                f"deadline_s: expected a positive number of seconds, got {deadline_s!r}"
            )
        now = time.monotonic()
        record, status = self._post(op, info, ranges, notif, deadline_s)
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self._entries[handle] = _Entry(record, peer, now + deadline_s, deadline_s, status)
        return handle

    def poll(self, handle: int) -> TransferStatus:
        entry = self._entry(handle)
        self._drain()
        status = entry.status
        if status.pending:
            status = self._check(entry.record)
            if status.pending and time.monotonic() > entry.deadline:
                self._stop(
                    entry,
                    f"deadline of {entry.deadline_s:g} s passed before the transfer with peer "
                    f"{entry.peer!r} finished",
                )
                return entry.status
            if status.failed:
                self._stop(entry, status.reason)
                return entry.status
            if status.done:
                self._discard(entry.record)
        elif not status.settled and self._settled(entry.record):
            self._discard(entry.record)
            status = TransferStatus.failure(status.reason.removesuffix(UNSETTLED))
        entry.status = status
        return status

    def release(self, handle: int) -> None:
        entry = self._entry(handle)
        del self._entries[handle]
        if entry.status.pending:
            self._cancel(entry.record)
        if entry.status.pending or not entry.status.settled:
            self._draining.append(entry.record)
        self._drain()

    def notifications(self) -> list[Notification]:
        self._check_open()
        return self._notifications()

    def close(self) -> None:
        if self._closed:
            return
        for entry in self._entries.values():
            if entry.status.pending:
                self._cancel(entry.record)
            if entry.status.pending or not entry.status.settled:
                self._draining.append(entry.record)
        for record in self._draining:
            self._discard(record)
        self._entries.clear()
        self._draining.clear()
        self._closed = True
        self._close()

    def __enter__(self) -> TransportBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise Closed(f"transport {self.name!r} is closed")

    def _peer(self, peer: str) -> PeerInfo:
        try:
            return self.peers[peer]
        except (KeyError, TypeError):
            raise NotFound(f"peer: unknown peer {peer!r} (known: {sorted(self.peers)})") from None

    def _stop(self, entry: _Entry, reason: str) -> None:
        """End a pending transfer as FAILED, stopping it as far as the backend can."""
        self._abandon(entry.record)
        settled = self._settled(entry.record)
        if settled:
            self._discard(entry.record)
        else:
            reason += UNSETTLED
        entry.status = TransferStatus.failure(reason, settled)

    def _drain(self) -> None:
        if self._draining:
            draining, self._draining = self._draining, []
            for record in draining:
                if self._settled(record):
                    self._discard(record)
                else:
                    self._draining.append(record)

    def _entry(self, handle: int) -> _Entry:
        try:
            return self._entries[handle]
        except (KeyError, TypeError):
            raise NotFound(f"handle: unknown or released transfer {handle!r}") from None

    # -- backend hooks ----------------------------------------------------------------

    def _register(self, arena: torch.Tensor, info: ArenaInfo) -> bytes:
        raise NotImplementedError

    def _register_regions(self, regions: list[torch.Tensor], region_map: RegionMap) -> bytes:
        raise InvalidInput(f"regions: backend {self.backend!r} registers one arena only")

    def _add_peer(self, info: PeerInfo) -> None:
        raise NotImplementedError

    def _remove_peer(self, peer: str) -> None:
        raise NotImplementedError

    def _post(
        self, op: Op, peer: PeerInfo, ranges: RangeBatch, notif: bytes, deadline_s: float
    ) -> tuple[Any, TransferStatus]:
        """Start a transfer; return its record and first status. A transfer that could not
        start comes back FAILED with its resources already freed, as does one DONE at once."""
        raise NotImplementedError

    def _check(self, record: Any) -> TransferStatus:
        raise NotImplementedError

    def _cancel(self, record: Any) -> None:
        """The caller gave up on this one pending transfer: stop it, sparing the others."""
        raise NotImplementedError

    def _abandon(self, record: Any) -> None:
        """The transfer missed its deadline or lost its peer: stop what can be stopped
        without hiding bytes that may still move (`_settled` must stay truthful)."""
        raise NotImplementedError

    def _settled(self, record: Any) -> bool:
        """Whether no byte of a stopped transfer can move any more."""
        raise NotImplementedError

    def _discard(self, record: Any) -> None:
        """Free the resources of a finished or settled transfer."""
        raise NotImplementedError

    def _notifications(self) -> list[Notification]:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError
