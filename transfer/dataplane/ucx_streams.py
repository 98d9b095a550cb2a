"""Send and receive framed range streams with ucxx (see ucx_wire for the framing)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from ucxx._lib import libucxx as ucx_api
from ucxx._lib.arr import Array

from transfer.dataplane.regions import RegionMap
from transfer.dataplane.ucx_wire import (
    HEADER_FRAMES,
    HEADER_SLOT,
    check_headers,
    chunks,
    header_rows,
)

Slicer = Callable[[int, int], Array]


def arena_slicer(arena: torch.Tensor) -> Slicer:
    """(offset, nbytes) -> a ucxx Array over that part of the arena, without copying."""
    if arena.device.type == "cuda":
        return lambda offset, nbytes: Array(arena[offset : offset + nbytes])
    view = memoryview(arena.numpy())
    return lambda offset, nbytes: Array(view[offset : offset + nbytes])


def regions_slicer(regions: list[torch.Tensor], region_map: RegionMap) -> Slicer:
    """`arena_slicer` over several regions: a virtual (offset, nbytes) of `region_map`
    -> a ucxx Array over that part of its region (InvalidInput if it crosses one)."""
    slicers = [arena_slicer(region) for region in regions]
    starts = [r.start for r in region_map.regions]

    def slicer(offset: int, nbytes: int) -> Array:
        index = int(region_map.indices(np.array([offset]), np.array([nbytes]), "range")[0])
        return slicers[index](offset - starts[index], nbytes)

    return slicer


_STATUS_NAMES = {
    -3: "IO_ERROR",
    -6: "UNREACHABLE",
    -9: "MESSAGE_TRUNCATED",
    -16: "CANCELED",
    -20: "TIMED_OUT",
    -24: "NOT_CONNECTED",
    -25: "CONNECTION_RESET",
    -80: "ENDPOINT_TIMEOUT",
}


def status_text(status: int) -> str:
    """-25 -> 'UCS_ERR_CONNECTION_RESET (-25)'."""
    return f"UCS_ERR_{_STATUS_NAMES.get(status, 'UNKNOWN')} ({status})"


def ucx_status(request: Any) -> int:
    """0 while pending or on success; a negative ucs_status_t once it failed."""
    return int(request.status) if request.completed else 0


@dataclass
class Receives:
    """Posted receives for one stream: ucxx headers into `rows`, frames into place."""

    rows: np.ndarray
    requests: list[Any]
    nbytes: np.ndarray
    cursor: int = 0  # requests before it have completed successfully
    error: int = 0  # the ucs_status_t of the first failed receive

    def advance(self) -> bool:
        """Step past completed receives; True when all are done. A failed receive stops
        the cursor and is reported by `error`."""
        requests = self.requests
        while self.cursor < len(requests) and requests[self.cursor].completed:
            status = int(requests[self.cursor].status)
            if status != 0:
                self.error = status
                return False
            self.cursor += 1
        return self.cursor == len(requests)

    def mismatch(self) -> str:
        return check_headers(self.rows, self.nbytes)


def post_receives(
    endpoint: Any, slicer: Slicer, offsets: np.ndarray, nbytes: np.ndarray, tag: int
) -> Receives:
    """Post, in stream order, a receive for every header and every frame of one stream."""
    rows = np.zeros((header_rows(len(nbytes)), HEADER_SLOT), dtype=np.uint8)
    requests = []
    utag = ucx_api.UCXXTag(tag)
    row = 0
    offset_list, nbytes_list = offsets.tolist(), nbytes.tolist()
    for start, stop in chunks(len(nbytes)):
        for _ in range(start, stop, HEADER_FRAMES):
            requests.append(endpoint.tag_recv(Array(rows[row]), utag))
            row += 1
        for i in range(start, stop):
            requests.append(endpoint.tag_recv(slicer(offset_list[i], nbytes_list[i]), utag))
    return Receives(rows, requests, nbytes)


def send_stream(
    endpoint: Any, slicer: Slicer, offsets: np.ndarray, nbytes: np.ndarray, tag: int
) -> list[Any]:
    """Send the ranges as one stream; returns one UCXBufferRequests per chunk."""
    utag = ucx_api.UCXXTag(tag)
    offset_list, nbytes_list = offsets.tolist(), nbytes.tolist()
    return [
        endpoint.tag_send_multi(
            tuple(slicer(offset_list[i], nbytes_list[i]) for i in range(start, stop)), utag
        )
        for start, stop in chunks(len(nbytes))
    ]


def sends_state(sends: list[Any]) -> tuple[bool, int]:
    """(all completed, first failing ucs_status_t or 0)."""
    for send in sends:
        if not send.completed:
            return False, 0
        status = int(send.status)
        if status != 0:
            return True, status
    return True, 0


def cancel_sends(sends: list[Any]) -> None:
    """Cancel every frame of the streams: dropping a UCXRequest wrapper cancels it."""
    for send in sends:
        send.requests  # noqa: B018 - materialise the per-frame wrappers, then drop them
    sends.clear()
