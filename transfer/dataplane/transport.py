"""The `Transport` protocol: what every data-plane backend offers, and `wait` on any of them.

A transport owns one registered arena and moves byte ranges between it and the arenas of
its peers. A transfer is a handle you poll: PENDING, then DONE or FAILED(reason). Every
transfer has a deadline; once it passes, `poll` stops what it can and answers FAILED. Its
ranges may be reused once the status is also `settled` (see TransferStatus). Transports
are not thread-safe: one owner thread calls them. The passive side needs no calls at all.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from transfer.dataplane.ranges import RangeBatch
from transfer.dataplane.types import Notification, Op, State, TransferStatus


@runtime_checkable
class Transport(Protocol):
    """Moves byte ranges between this rank's arena and its peers' arenas."""

    backend: str
    name: str

    def register(self, arena: torch.Tensor) -> bytes:
        """Register the arena (uint8 [nbytes], contiguous, CPU or CUDA) once; return the
        metadata a peer passes to `add_peer`."""
        ...

    def register_regions(self, regions: Sequence[torch.Tensor]) -> bytes:
        """Register several memory regions (uint8 [nbytes] each, contiguous, one device)
        once, instead of one arena; offsets in ranges are then virtual offsets of a
        `RegionMap` (`transfer.dataplane.regions`) that `region_map` describes. No range
        may cross a region boundary. Return the metadata a peer passes to `add_peer`."""
        ...

    def add_peer(self, metadata: bytes) -> str:
        """Connect to the peer described by `metadata`; return its name."""
        ...

    def remove_peer(self, peer: str) -> None:
        """Forget a peer. Its pending transfers fail with reason 'peer removed'."""
        ...

    def post(
        self, op: Op, peer: str, ranges: RangeBatch, notif: bytes = b"", *, deadline_s: float
    ) -> int:
        """Start moving `ranges` (READ: peer -> local, WRITE: local -> peer). `notif`, when
        non-empty, reaches the peer's `notifications()` once the bytes have landed."""
        ...

    def poll(self, handle: int) -> TransferStatus:
        """PENDING, DONE or FAILED; FAILED at the latest once the deadline has passed."""
        ...

    def release(self, handle: int) -> None:
        """Forget a transfer. A pending one is cancelled as far as the backend can; poll
        until `settled` first if its ranges will be reused."""
        ...

    def notifications(self) -> list[Notification]:
        """Notifications received since the last call."""
        ...

    def close(self) -> None: ...


def wait(transport: Transport, handle: int, interval_s: float = 0.0002) -> TransferStatus:
    """Poll until the transfer leaves PENDING; its deadline bounds the wait."""
    while True:
        status = transport.poll(handle)
        if status.state is not State.PENDING:
            return status
        time.sleep(interval_s)
