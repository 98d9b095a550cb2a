"""The serving half of the UCX backend: a thread that answers peers' READ and WRITE
requests against this rank's arena, so the owner needs to call nothing to be read from."""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ucxx._lib import libucxx as ucx_api
from ucxx._lib.arr import Array

from transfer.dataplane.types import Notification
from transfer.dataplane.ucx_streams import (
    Receives,
    Slicer,
    cancel_sends,
    post_receives,
    send_stream,
    sends_state,
    status_text,
)
from transfer.dataplane.ucx_wire import (
    KIND_MASK,
    OP_READ,
    REQUEST_TAG,
    Request,
    ack_tag,
    data_tag,
    decode_request,
    encode_ack,
)

log = logging.getLogger(__name__)

GRACE_S = 5.0  # a job outlives its requester's deadline by this much before it is dropped
IDLE_SLEEP_S = 0.001
BUSY_SLEEP_S = 0.00005


@dataclass
class _Job:
    request: Request
    endpoint: Any
    expires: float
    sends: list[Any] = field(default_factory=list)  # READ: our stream to the requester
    receives: Receives | None = None  # WRITE: the requester's stream into the arena
    refusal: str = ""  # a refused WRITE still drains its stream into scratch
    scratch: np.ndarray | None = None


class UcxServer:
    def __init__(self, worker: Any, slicer: Slicer, arena_bytes: int) -> None:
        self._worker = worker
        self._slicer = slicer
        self._arena_bytes = arena_bytes
        self._incoming: list[tuple[Any, np.ndarray]] = []
        self._jobs: list[_Job] = []
        self._acks: list[tuple[Any, np.ndarray]] = []
        self._retained: list[Any] = []  # buffers of expired receives, kept till stop
        self._endpoints: dict[bytes, Any] = {}
        self._notifications: collections.deque[Notification] = collections.deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdxfer-ucx-server", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving. Requests already posted stay posted until `drop`."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def drop(self) -> None:
        """Cancel and free everything; call once the worker's progress has stopped."""
        self.stop()
        for job in self._jobs:
            cancel_sends(job.sends)
        self._jobs.clear()
        self._incoming.clear()
        self._acks.clear()
        self._endpoints.clear()
        self._retained.clear()

    def take_notifications(self) -> list[Notification]:
        taken = []
        while self._notifications:
            taken.append(self._notifications.popleft())
        return taken

    def _run(self) -> None:
        sleep = IDLE_SLEEP_S
        while not self._stop.is_set():
            try:
                busy = self._accept()
                self._read_requests()
                busy |= self._advance()
            except Exception:  # the server must outlive any one bad peer
                log.exception("ucx server step failed")
                busy = False
            sleep = BUSY_SLEEP_S if busy else min(sleep * 2, IDLE_SLEEP_S)
            time.sleep(sleep)

    def _accept(self) -> bool:
        probe = self._worker.tag_probe(
            ucx_api.UCXXTag(REQUEST_TAG), ucx_api.UCXXTagMask(KIND_MASK), remove=True
        )
        if not probe.matched:
            return False
        buffer = np.empty(probe.length, dtype=np.uint8)
        self._incoming.append((self._worker.tag_recv_with_handle(Array(buffer), probe), buffer))
        return True

    def _read_requests(self) -> None:
        incoming, self._incoming = self._incoming, []
        for receive, buffer in incoming:
            if not receive.completed:
                self._incoming.append((receive, buffer))
            elif receive.status == 0:
                try:
                    self._start(decode_request(buffer))
                except Exception:  # a malformed request or an unreachable requester
                    log.exception("ucx server dropped a request")

    def _endpoint(self, address: bytes) -> Any:
        endpoint = self._endpoints.get(address)
        if endpoint is None or not endpoint.alive:
            self._endpoints = {a: e for a, e in self._endpoints.items() if e.alive}
            endpoint = ucx_api.UCXEndpoint.create_from_worker_address(
                self._worker, ucx_api.UCXAddress.create_from_buffer(address), True
            )
            self._endpoints[address] = endpoint
        return endpoint

    def _start(self, request: Request) -> None:
        endpoint = self._endpoint(request.reply_address)
        job = _Job(request, endpoint, time.monotonic() + request.deadline_s + GRACE_S)
        ends = request.offsets + request.nbytes
        if request.offsets.min() < 0 or request.nbytes.min() <= 0 or ends.max() > self._arena_bytes:
            job.refusal = f"ranges leave the served arena of {self._arena_bytes} bytes"
        tag = data_tag(request.transfer_id)
        if request.op == OP_READ:
            if job.refusal:
                self._ack(job, job.refusal)
                return
            job.sends = send_stream(endpoint, self._slicer, request.offsets, request.nbytes, tag)
            self._ack(job, "")
        else:
            slicer = self._slicer
            if job.refusal:  # drain the stream; the job keeps the scratch alive
                job.scratch = np.empty(int(request.nbytes.max()), dtype=np.uint8)
                scratch = memoryview(job.scratch)
                slicer = lambda _offset, nbytes: Array(scratch[:nbytes])  # noqa: E731
            job.receives = post_receives(endpoint, slicer, request.offsets, request.nbytes, tag)
        self._jobs.append(job)

    def _advance(self) -> bool:
        now = time.monotonic()
        active = []
        for job in self._jobs:
            if not self._finished(job) and now < job.expires:
                active.append(job)
                continue
            cancel_sends(job.sends)
            if job.receives is not None and not job.receives.advance():
                self._retained.append((job.receives.rows, job.scratch))  # UCX may still write
        progressed = len(active) != len(self._jobs)
        self._jobs = active
        self._acks = [(send, buffer) for send, buffer in self._acks if not send.completed]
        return progressed

    def _finished(self, job: _Job) -> bool:
        request = job.request
        if job.receives is not None:  # WRITE
            done = job.receives.advance()
            if job.receives.error:
                self._ack(job, f"receiving failed: {status_text(job.receives.error)}")
                return True
            if not done:
                return False
            reason = job.refusal or job.receives.mismatch()
            self._ack(job, reason)
            if reason:
                return True
        else:  # READ
            done, status = sends_state(job.sends)
            if not done or status:
                return done
        if request.notif:
            self._notifications.append(Notification(request.requester, request.notif))
        return True

    def _ack(self, job: _Job, reason: str) -> None:
        message = encode_ack(reason)
        tag = ucx_api.UCXXTag(ack_tag(job.request.transfer_id))
        try:
            self._acks.append((job.endpoint.tag_send(Array(message), tag), message))
        except Exception:  # the requester is gone; its deadline covers it
            log.debug("ack to %s failed", job.request.requester, exc_info=True)
