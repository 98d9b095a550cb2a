"""Prefill instance: the gRPC-facing side of the prefill engine.

`PrefillWorker.prefill` and `stage` check their input, submit the work to the instance's
one engine loop (`transfer.serving.engine.prefill_engine`) and wait for its answer; the
engine alone commands the ranks. The ticket store's free callback only queues an event for
that loop, which gives the cache back.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from transfer.control.metrics import WorkerMetrics
from transfer.control.types import (
    HandshakeReply,
    PrefillRequest,
    StageRequest,
    Ticket,
    compat_hash,
)
from transfer.errors import DeadlineExceeded, InvalidInput
from transfer.serving.engine.instance import Instance
from transfer.serving.engine.prefill_engine import PrefillEngine
from transfer.serving.ranks.spec import Copies

STAGE_WAIT_S = 60.0  # a Stage call waits this long for its gather's step


class PrefillWorker:
    """Serves `Prefill` and (through `store`) the TransferService of one instance."""

    def __init__(
        self,
        instance: Instance,
        instance_id: str,
        address: str,
        lease_s: float,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.instance = instance
        self.instance_id = instance_id
        self.engine = PrefillEngine(instance, instance_id, address, lease_s, metrics)
        self.store = self.engine.store
        self.identity = HandshakeReply(
            instance_id=instance_id,
            compat=instance.compat,
            compat_hash=compat_hash(instance.compat),
            rank_metadata=instance.rank_metadata,
            rank_layouts=instance.rank_layouts,
        )
        if metrics is not None:
            engine = self.engine
            metrics.track_requests(
                running=lambda: engine.num_running, waiting=lambda: engine.num_waiting
            )
            staging = instance.staging
            metrics.track_staging(free=lambda: staging.free_bytes, total=staging.capacity_bytes)

    def start(self) -> PrefillWorker:
        self.store.start()
        return self

    def prefill(
        self, request: PrefillRequest, is_cancelled: Callable[[], bool] | None = None
    ) -> Ticket:
        """Run the prompt; the ticket names the blocks and slot that hold its cache. Once
        `is_cancelled()` is true the prompt stops at its next chunk and frees its cache.
        With `--transfer-mode layerwise` the ticket comes back as soon as the cache is
        allocated, and the prompt runs in the engine's next steps."""
        if not request.prompt_ids:
            raise InvalidInput("prompt_ids: must not be empty")
        vocab = self.instance.config.geometry.vocab_size
        bad = [t for t in request.prompt_ids if t >= vocab]
        if bad:
            raise InvalidInput(f"prompt_ids: token ids must be < vocab size {vocab}, got {bad[:5]}")
        outcome = self.engine.submit(request, is_cancelled).out.get()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def stage(self, request: StageRequest) -> int:
        """Pack a held ticket's ranges (`request.ranks[r]` on rank r) back to back into one
        staging extent; returns its arena offset, the same on every rank. The extent goes
        back with the ticket. CapacityError when no extent is free: the caller reads the
        ranges directly."""
        layouts = self.instance.layouts
        if len(request.ranks) != len(layouts):
            raise InvalidInput(
                f"ranks: {len(request.ranks)} given, this instance has tp {len(layouts)}"
            )
        if request.nbytes == 0:
            raise InvalidInput("ranks: no range to stage")
        copies = tuple(_packed(g.src_offsets, g.lengths) for g in request.ranks)
        future = self.engine.stage(request.request_id, copies, request.nbytes)
        try:
            return future.result(STAGE_WAIT_S)
        except TimeoutError:
            raise DeadlineExceeded(
                f"request_id {request.request_id!r}: staging took over {STAGE_WAIT_S:g} s"
            ) from None

    def settle(self, timeout_s: float = 30.0) -> bool:
        """Whether the cache of every request freed so far is back in the pools and
        released on the ranks, waiting up to `timeout_s`."""
        return self.engine.settle(timeout_s)

    def close(self) -> None:
        self.engine.close()
        self.store.stop()


def _packed(src_offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Copies:
    """The ranges back to back from offset 0 (the engine moves them to their extent)."""
    src = np.array(src_offsets, dtype=np.int64)
    nbytes = np.array(lengths, dtype=np.int64)
    dst = np.concatenate(([0], np.cumsum(nbytes)[:-1])).astype(np.int64)
    return Copies(src, dst[: len(nbytes)], nbytes)
