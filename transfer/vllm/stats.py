"""The connector's numbers, through vLLM's own connector-stats and Prometheus hooks.

Workers record one entry per finished transfer (bytes, descriptors, seconds) and count failed
ones; the prefill scheduler counts expired leases. vLLM ships `PdxferStats.data` from every
process to its logger, aggregates, and hands it to `PdxferPromMetrics.observe`, which feeds the
`vllm:pdxfer_*` histograms and counters on the server's `/metrics`.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine


class Series(str, enum.Enum):
    """The keys of `PdxferStats.data`: per-transfer observations, then counted events."""

    XFER_SECONDS = "xfer_seconds"
    BYTES = "bytes_transferred"
    DESCRIPTORS = "num_descriptors"
    FAILED_TRANSFERS = "num_failed_transfers"
    EXPIRED_LEASES = "num_expired_leases"
    VERIFY_FAILURES = "num_verify_failures"


PER_TRANSFER = (Series.XFER_SECONDS, Series.BYTES, Series.DESCRIPTORS)
COUNTED = (Series.FAILED_TRANSFERS, Series.EXPIRED_LEASES, Series.VERIFY_FAILURES)


@dataclass
class PdxferStats(KVConnectorStats):
    """One interval's observations; `data` maps each `Series` value to a list (picklable)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:  # its own lists: aggregating into it must not change the caller's
            self.data = {key: list(values) for key, values in self.data.items()}
            for series in Series:  # a peer built by an older build may lack a series
                self.data.setdefault(series.value, [])

    def reset(self) -> None:
        self.data = {series.value: [] for series in Series}

    def record_transfer(self, nbytes: int, descriptors: int, seconds: float) -> None:
        """One finished transfer of a request (on one decode rank)."""
        self.data[Series.BYTES.value].append(int(nbytes))
        self.data[Series.DESCRIPTORS.value].append(int(descriptors))
        self.data[Series.XFER_SECONDS.value].append(float(seconds))

    def record_failed_transfer(self) -> None:
        self.data[Series.FAILED_TRANSFERS.value].append(1)

    def record_verify_failure(self) -> None:
        """A load whose bytes differ from prefill's digests (verify; it counts as a failed
        transfer too)."""
        self.data[Series.VERIFY_FAILURES.value].append(1)

    def record_expired_leases(self, count: int = 1) -> None:
        """Prefill freed `count` requests whose lease lapsed before decode released them."""
        if count > 0:
            self.data[Series.EXPIRED_LEASES.value].append(int(count))

    def clone_and_reset(self) -> PdxferStats:
        old = copy.copy(self)
        self.reset()
        return old

    @property
    def num_transfers(self) -> int:
        return len(self.data[Series.XFER_SECONDS.value])

    def is_empty(self) -> bool:
        return not any(self.data[series.value] for series in Series)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval in a few numbers, for vLLM's periodic log line."""
        counts = {
            "Num failed transfers": sum(self.data[Series.FAILED_TRANSFERS.value]),
            "Num expired leases": sum(self.data[Series.EXPIRED_LEASES.value]),
            "Num verify failures": sum(self.data[Series.VERIFY_FAILURES.value]),
        }
        n = self.num_transfers
        if n == 0:
            return {"Num successful transfers": 0, **counts}
        seconds = np.asarray(self.data[Series.XFER_SECONDS.value], dtype=np.float64)
        mib = np.asarray(self.data[Series.BYTES.value], dtype=np.float64) / 2**20
        descriptors = np.asarray(self.data[Series.DESCRIPTORS.value], dtype=np.float64)
        total_s = float(seconds.sum())
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(float(seconds.mean()) * 1e3, 3),
            "P90 xfer time (ms)": round(float(np.percentile(seconds, 90)) * 1e3, 3),
            "Avg MB per transfer": round(float(mib.mean()), 3),
            "Throughput (MB/s)": round(float(mib.sum()) / total_s, 3) if total_s > 0 else 0.0,
            "Avg number of descriptors": round(float(descriptors.mean()), 1),
            **counts,
        }


XFER_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
BYTES_BUCKETS = tuple(2 ** (10 + i) for i in range(1, 25, 2))  # 2 KiB .. 8 GiB
DESCRIPTOR_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 16384, 65536)


class PdxferPromMetrics(KVConnectorPromMetrics):
    """Registers `vllm:pdxfer_*` on vLLM's Prometheus registry, one child per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        histograms = (
            (Series.XFER_SECONDS, "vllm:pdxfer_xfer_time_seconds", "Seconds per pdxfer KV cache transfer (one request, one decode rank).", XFER_SECONDS_BUCKETS),
            (Series.BYTES, "vllm:pdxfer_bytes_transferred", "Bytes moved per pdxfer KV cache transfer.", BYTES_BUCKETS),
            (Series.DESCRIPTORS, "vllm:pdxfer_num_descriptors", "Transport descriptors per pdxfer KV cache transfer.", DESCRIPTOR_BUCKETS),
        )  # fmt: skip
        self._histograms = {
            series: per_engine(
                self._histogram_cls(
                    name=name, documentation=doc, buckets=list(buckets), labelnames=labelnames
                )
            )
            for series, name, doc, buckets in histograms
        }
        counters = (
            (Series.FAILED_TRANSFERS, "vllm:pdxfer_num_failed_transfers", "pdxfer KV cache transfers that failed (decode side)."),
            (Series.EXPIRED_LEASES, "vllm:pdxfer_num_expired_leases", "Requests whose cache prefill freed because decode's lease lapsed."),
            (Series.VERIFY_FAILURES, "vllm:pdxfer_num_verify_failures", "pdxfer loads whose bytes differed from prefill's digests (verify; vLLM recomputed them)."),
        )  # fmt: skip
        self._counters = {
            series: per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            )
            for series, name, doc in counters
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for series, metric in self._histograms.items():
            for value in transfer_stats_data.get(series.value, ()):
                metric[engine_idx].observe(value)
        for series, metric in self._counters.items():
            total = sum(transfer_stats_data.get(series.value, ()))
            if total:
                metric[engine_idx].inc(total)
