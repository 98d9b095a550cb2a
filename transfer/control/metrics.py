"""Per-worker Prometheus metrics on the worker's own `CollectorRegistry`.

A private registry (not prometheus_client's global one) lets several workers,
or several tests, live in one process. Pool gauges read callables the owner
registers with `track_pools`, so the numbers are read at scrape time and never
go stale.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

from transfer.errors import InvalidInput

TRANSFER_SECONDS_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


BLOCK_RUNS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class WorkerMetrics:
    """The public metric names of one worker (see docs/control.md)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.kv_blocks_free = Gauge(
            "pdxfer_kv_blocks_free",
            "KV cache blocks an allocation can have: free, or held only by the prefix cache",
            registry=r,
        )
        self.kv_blocks_total = Gauge(
            "pdxfer_kv_blocks_total", "KV cache blocks in this worker's pool", registry=r
        )
        self.state_slots_free = Gauge(
            "pdxfer_state_slots_free", "Linear-attention state slots free", registry=r
        )
        self.state_slots_total = Gauge(
            "pdxfer_state_slots_total", "Linear-attention state slots in the pool", registry=r
        )
        self.tickets_active = Gauge(
            "pdxfer_tickets_active", "Published tickets not yet freed", registry=r
        )
        self.leases_expired = Counter(
            "pdxfer_leases_expired", "Tickets freed because their lease expired", registry=r
        )
        self.transfers = Counter(
            "pdxfer_transfers", "Finished cache transfers by status", ["status"], registry=r
        )
        self.transfer_bytes = Counter(
            "pdxfer_transfer_bytes",
            "Bytes moved by cache transfers, by kind (kv, state)",
            ["kind"],
            registry=r,
        )
        self.transfer_descriptors = Counter(
            "pdxfer_transfer_descriptors",
            "Transport descriptors posted by cache transfers",
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "pdxfer_transfer_seconds",
            "Wall time of one cache transfer",
            buckets=TRANSFER_SECONDS_BUCKETS,
            registry=r,
        )
        self.transfer_exposed_seconds = Histogram(
            "pdxfer_transfer_exposed_seconds",
            "Transfer time a request's TTFT sees: a whole transfer from the ticket's arrival, "
            "a layer-wise stream from prefill finishing, to every byte landed",
            buckets=TRANSFER_SECONDS_BUCKETS,
            registry=r,
        )
        self.kv_block_runs = Histogram(
            "pdxfer_kv_block_runs",
            "Runs of consecutive KV block ids per allocated request (fragmentation)",
            buckets=BLOCK_RUNS_BUCKETS,
            registry=r,
        )
        self.kv_block_runs_last = Gauge(
            "pdxfer_kv_block_runs_last",
            "Runs of consecutive KV block ids of the latest allocated request",
            registry=r,
        )

        self.staging_free_bytes = Gauge(
            "pdxfer_staging_free_bytes", "Free bytes of the staging pool (per rank)", registry=r
        )
        self.staging_total_bytes = Gauge(
            "pdxfer_staging_total_bytes", "Bytes of the staging pool (per rank)", registry=r
        )
        self.transfers_staged = Counter(
            "pdxfer_transfers_staged",
            "Transfers whose small ranges were packed into staging (counted where staged)",
            registry=r,
        )

        self.prefix_counters = {
            name: Counter(f"pdxfer_prefix_{name}", text, registry=r)
            for name, text in (
                ("hits", "Prompts that started from a cached prefix and state checkpoint"),
                ("misses", "Prompts that found no cached prefix"),
                ("hit_tokens", "Prompt tokens served from the prefix cache"),
                ("checkpoint_saves", "State checkpoints saved"),
                ("block_evictions", "Cached KV blocks evicted"),
                ("checkpoint_evictions", "State checkpoints evicted"),
            )
        }
        self._prefix_seen: dict[str, int] = dict.fromkeys(self.prefix_counters, 0)

        self.requests_running = Gauge(
            "pdxfer_requests_running", "Requests in the decode batch (or joining it)", registry=r
        )
        self.ranks_silent = Gauge(
            "pdxfer_ranks_silent",
            "TP ranks of this instance that missed their heartbeats (frozen or dying): "
            "above 0 the instance is degraded",
            registry=r,
        )
        self.requests_waiting = Gauge(
            "pdxfer_requests_waiting", "Requests waiting for cache room", registry=r
        )
        self.batch_size = Histogram(
            "pdxfer_batch_size",
            "Requests in one decode step",
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "pdxfer_step_seconds",
            "Wall time of one batched decode step (all ranks)",
            buckets=STEP_SECONDS_BUCKETS,
            registry=r,
        )

    def track_requests(self, *, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        """Read the request gauges from the owner's callables at scrape time."""
        self.requests_running.set_function(running)
        self.requests_waiting.set_function(waiting)

    def track_staging(self, *, free: Callable[[], float], total: float) -> None:
        """Read the staging pool's free bytes at scrape time."""
        self.staging_free_bytes.set_function(free)
        self.staging_total_bytes.set(total)

    def record_decode_step(self, batch_size: int, seconds: float) -> None:
        """One batched decode step of `batch_size` requests took `seconds`."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidInput(f"batch_size: must be an integer >= 1, got {batch_size!r}")
        if seconds < 0:
            raise InvalidInput(f"seconds: must be >= 0, got {seconds}")
        self.batch_size.observe(batch_size)
        self.step_seconds.observe(seconds)

    def track_pools(
        self,
        *,
        kv_blocks_free: Callable[[], float],
        kv_blocks_total: Callable[[], float],
        state_slots_free: Callable[[], float],
        state_slots_total: Callable[[], float],
    ) -> None:
        """Read the pool gauges from the owner's callables at scrape time."""
        self.kv_blocks_free.set_function(kv_blocks_free)
        self.kv_blocks_total.set_function(kv_blocks_total)
        self.state_slots_free.set_function(state_slots_free)
        self.state_slots_total.set_function(state_slots_total)

    def record_transfer(
        self,
        status: str,
        seconds: float,
        bytes_by_kind: Mapping[str, int] | None = None,
        descriptors: int = 0,
        exposed_s: float | None = None,
    ) -> None:
        """Count one finished transfer (status e.g. "done" / "failed"), with the part of it
        its request's TTFT saw (`exposed_s`) when known; a rejected call counts nothing."""
        bytes_by_kind = dict(bytes_by_kind or {})
        if not status:
            raise InvalidInput("status: must be a non-empty string")
        if seconds < 0 or descriptors < 0:
            raise InvalidInput(f"seconds/descriptors: must be >= 0, got {seconds}, {descriptors}")
        for kind, nbytes in bytes_by_kind.items():
            if nbytes < 0:
                raise InvalidInput(f"bytes_by_kind[{kind!r}]: must be >= 0, got {nbytes}")
        if exposed_s is not None and exposed_s < 0:
            raise InvalidInput(f"exposed_s: must be >= 0, got {exposed_s}")
        self.transfers.labels(status=status).inc()
        self.transfer_seconds.observe(seconds)
        self.transfer_descriptors.inc(descriptors)
        if exposed_s is not None:
            self.transfer_exposed_seconds.observe(exposed_s)
        for kind, nbytes in bytes_by_kind.items():
            self.transfer_bytes.labels(kind=kind).inc(nbytes)

    def record_block_runs(self, runs: int) -> None:
        """One request's KV blocks came in `runs` runs of consecutive ids (0: no blocks)."""
        if isinstance(runs, bool) or not isinstance(runs, int) or runs < 0:
            raise InvalidInput(f"runs: must be an integer >= 0, got {runs!r}")
        self.kv_block_runs.observe(runs)
        self.kv_block_runs_last.set(runs)

    def record_prefix(self, counts: Mapping[str, int]) -> None:
        """Advance the prefix-cache counters to `counts` (`PrefixCache.counts()`, which
        only grow)."""
        for name, counter in self.prefix_counters.items():
            value = counts[name]
            counter.inc(max(0, value - self._prefix_seen[name]))
            self._prefix_seen[name] = max(value, self._prefix_seen[name])

    def render(self) -> bytes:
        """The Prometheus text exposition of this worker's registry."""
        return generate_latest(self.registry)


@dataclass
class MetricsServer:
    """A running `/metrics` HTTP endpoint; `stop()` shuts it down."""

    host: str
    port: int
    _server: object
    _thread: threading.Thread

    def stop(self, timeout: float = 5.0) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout)


def serve_metrics(metrics: WorkerMetrics, host: str = "0.0.0.0", port: int = 0) -> MetricsServer:
    """Serve `metrics` as Prometheus text over HTTP; port 0 picks a free port."""
    server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    return MetricsServer(host=host, port=server.server_port, _server=server, _thread=thread)
