"""UCX backend over ucxx, the maintained successor of ucx-py.

ucxx's Python API has tagged, stream and active-message transfers, not one-sided RMA, so
each registered arena is served by a thread (`UcxServer`): it sends the ranges a READ asks
for with `tag_send_multi`, and receives a WRITE's ranges. The requester receives a READ
straight into its destination ranges. ucx_wire describes the protocol.

No listener: peers connect to the worker address carried in the metadata. A worker's
progress thread blocks in epoll when idle, so an idle transport costs no CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from transfer.errors import InvalidInput

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets UCX_MEMTYPE_CACHE

import numpy as np  # noqa: E402
import torch  # noqa: E402
from ucxx._lib import libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

from transfer.dataplane.arena_info import ArenaInfo  # noqa: E402
from transfer.dataplane.base import TransportBase  # noqa: E402
from transfer.dataplane.metadata import PeerInfo  # noqa: E402
from transfer.dataplane.ranges import RangeBatch  # noqa: E402
from transfer.dataplane.regions import RegionMap  # noqa: E402
from transfer.dataplane.types import DONE, PENDING, Notification, Op, TransferStatus  # noqa: E402
from transfer.dataplane.ucx_server import UcxServer  # noqa: E402
from transfer.dataplane.ucx_streams import (  # noqa: E402
    Receives,
    arena_slicer,
    cancel_sends,
    post_receives,
    regions_slicer,
    send_stream,
    sends_state,
    status_text,
    ucx_status,
)
from transfer.dataplane.ucx_wire import (  # noqa: E402
    ACK_BYTES,
    OP_READ,
    OP_WRITE,
    REQUEST_TAG,
    Request,
    ack_tag,
    data_tag,
    decode_ack,
    encode_request,
    new_transfer_id,
)

EPOLL_TIMEOUT_MS = 10


@dataclass
class _UcxTransfer:
    op: Op
    peer: str
    endpoint: Any
    ack_buffer: np.ndarray = field(default_factory=lambda: np.zeros(ACK_BYTES, dtype=np.uint8))
    ack: Any = None
    request: Any = None  # the send of the request message, and its buffer
    request_buffer: np.ndarray | None = None
    receives: Receives | None = None  # READ
    sends: list[Any] = field(default_factory=list)  # WRITE
    acked: bool = False


class UcxTransport(TransportBase):
    """Options: `tls` (UCX_TLS for this context, e.g. "tcp" or "shm,cma,tcp"; default UCX's
    choice), `net_devices` (UCX_NET_DEVICES, e.g. "lo"), `polling` (spin the progress
    thread instead of sleeping in epoll: lower latency, one busy core)."""

    backend = "ucx"

    def __init__(
        self,
        agent_name: str,
        *,
        tls: str | None = None,
        net_devices: str | None = None,
        polling: bool = False,
    ) -> None:
        super().__init__(agent_name)
        config = {}
        for option, key, value in (
            ("tls", "TLS", tls),
            ("net_devices", "NET_DEVICES", net_devices),
        ):
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise InvalidInput(f"{option}: expected a non-empty string, got {value!r}")
                config[key] = value
        features = (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP)
        self._context = ucx_api.UCXContext(config, feature_flags=features)
        self._worker = ucx_api.UCXWorker(self._context)
        self._worker.start_progress_thread(
            polling_mode=bool(polling), epoll_timeout=EPOLL_TIMEOUT_MS
        )
        self._address = bytes(self._worker.address)
        self._endpoints: dict[bytes, Any] = {}
        self._retained: list[Any] = []  # buffers of cancelled requests, kept till close
        self._tensor: torch.Tensor | None = None
        self._slicer: Any = None
        self._server: UcxServer | None = None

    def _register(self, arena: torch.Tensor, info: ArenaInfo) -> bytes:
        self._tensor = arena
        self._slicer = arena_slicer(arena)
        self._server = UcxServer(self._worker, self._slicer, info.nbytes)
        self._server.start()
        return self._address

    def _register_regions(self, regions: list[torch.Tensor], region_map: RegionMap) -> bytes:
        self._tensor = regions[0]
        self._slicer = regions_slicer(regions, region_map)
        self._server = UcxServer(self._worker, self._slicer, region_map.extent)
        self._server.start()
        return self._address

    def _add_peer(self, info: PeerInfo) -> None:
        self._endpoint(info)

    def _endpoint(self, info: PeerInfo) -> Any:
        # Endpoints live as long as the transport, keyed by worker address: with ucxx 0.52 a
        # fresh endpoint to a worker whose previous endpoint was closed loses its receives
        # (UCS_ERR_CANCELED), so re-adding a peer reuses the first one.
        endpoint = self._endpoints.get(info.payload)
        if endpoint is None:
            address = ucx_api.UCXAddress.create_from_buffer(info.payload)
            endpoint = ucx_api.UCXEndpoint.create_from_worker_address(self._worker, address, True)
            self._endpoints[info.payload] = endpoint
        return endpoint

    def _remove_peer(self, peer: str) -> None:
        pass

    def _post(
        self, op: Op, peer: PeerInfo, ranges: RangeBatch, notif: bytes, deadline_s: float
    ) -> tuple[_UcxTransfer | None, TransferStatus]:
        ranges = ranges.coalesced()
        endpoint = self._endpoint(peer)
        record = _UcxTransfer(op, peer.name, endpoint)
        tid = new_transfer_id()
        try:
            record.ack = endpoint.tag_recv(Array(record.ack_buffer), ucx_api.UCXXTag(ack_tag(tid)))
            if op is Op.READ:
                record.receives = post_receives(
                    endpoint, self._slicer, ranges.local, ranges.nbytes, data_tag(tid)
                )
            request = Request(
                OP_READ if op is Op.READ else OP_WRITE,
                tid,
                self.name,
                self._address,
                notif,
                ranges.remote,
                ranges.nbytes,
                deadline_s,
            )
            record.request_buffer = encode_request(request)
            record.request = endpoint.tag_send(
                Array(record.request_buffer), ucx_api.UCXXTag(REQUEST_TAG)
            )
            if op is Op.WRITE:
                record.sends = send_stream(
                    endpoint, self._slicer, ranges.local, ranges.nbytes, data_tag(tid)
                )
        except Exception as exc:  # ucxx raises its own errors for dead endpoints
            self._cancel(record)
            return None, TransferStatus.failure(
                f"could not post transfer: {type(exc).__name__}: {exc}"
            )
        return record, PENDING

    def _check(self, record: _UcxTransfer) -> TransferStatus:
        for what, status in (
            ("sending the request", ucx_status(record.request)),
            ("the acknowledgement", ucx_status(record.ack)),
        ):
            if status:
                return self._failure(record, f"{what} failed: {status_text(status)}")
        if not record.acked and record.ack.completed:
            reason = decode_ack(record.ack_buffer)
            if reason is not None:  # it sends nothing (READ) or drains our stream (WRITE)
                self._cancel(record)
                return TransferStatus.failure(f"peer {record.peer!r} refused: {reason}")
            record.acked = True
        if record.receives is not None:
            done = record.receives.advance()
            if record.receives.error:
                return self._failure(
                    record, f"receiving failed: {status_text(record.receives.error)}"
                )
            if not (done and record.acked):
                return PENDING
            mismatch = record.receives.mismatch()
            return TransferStatus.failure(mismatch) if mismatch else DONE
        done, status = sends_state(record.sends)
        if status:
            return self._failure(record, f"sending failed: {status_text(status)}")
        return DONE if done and record.acked else PENDING

    def _failure(self, record: _UcxTransfer, what: str) -> TransferStatus:
        hint = "" if record.endpoint.alive else f" (endpoint to {record.peer!r} closed: peer gone?)"
        return TransferStatus.failure(what + hint)

    def _requests(self, record: _UcxTransfer) -> list[Any]:
        receives = record.receives.requests if record.receives is not None else []
        return [r for r in (record.ack, record.request) if r is not None] + receives + record.sends

    def _cancel(self, record: _UcxTransfer) -> None:
        # Dropping a ucxx request wrapper cancels the request; a receive that already
        # matched its message cannot be cancelled and may still complete. UCX holds raw
        # pointers, so the buffers of requests still in flight live until `close`.
        if not self._settled(record):
            rows = record.receives.rows if record.receives is not None else None
            self._retained.append((record.ack_buffer, record.request_buffer, rows))
        if record.receives is not None:
            record.receives.requests.clear()
        cancel_sends(record.sends)
        record.ack = record.request = None

    def _abandon(self, record: _UcxTransfer) -> None:
        # Keep every request: the transfer settles when they all complete, as they do when
        # the peer answers late or its endpoint fails (ucxx then cancels them).
        pass

    def _settled(self, record: _UcxTransfer) -> bool:
        return all(r.completed for r in self._requests(record))

    def _discard(self, record: _UcxTransfer) -> None:
        self._cancel(record)

    def _notifications(self) -> list[Notification]:
        return self._server.take_notifications() if self._server is not None else []

    def _close(self) -> None:
        if self._server is not None:
            self._server.stop()
        # Once progress has stopped UCX touches no buffer, so they may all go.
        self._worker.stop_progress_thread()
        if self._server is not None:
            self._server.drop()
            self._server = None
        self._endpoints.clear()
        self._tensor = self._slicer = None
        self._retained.clear()
        del self._worker, self._context  # destroying the worker tells connected peers
