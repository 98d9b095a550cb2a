"""PdxferStats crosses processes as plain data and aggregates; PdxferPromMetrics exposes the
vllm:pdxfer_* histograms and counters."""

from __future__ import annotations

import functools
import pickle

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from prometheus_client.exposition import generate_latest  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402

from transfer.vllm import PdxferConnector  # noqa: E402
from transfer.vllm.stats import PdxferStats  # noqa: E402


def test_stats_record_aggregate_reduce():
    worker0, worker1 = PdxferStats(), PdxferStats()
    assert worker0.is_empty()
    worker0.record_transfer(1_000_000, 3, 0.002)
    worker1.record_transfer(3_000_000, 5, 0.004)
    worker1.record_failed_transfer()
    shipped = pickle.loads(pickle.dumps(worker1.data))  # vLLM ships .data between processes
    total = PdxferConnector.build_kv_connector_stats(worker0.data).aggregate(
        PdxferConnector.build_kv_connector_stats(shipped)
    )
    reduced = total.reduce()
    assert reduced["Num successful transfers"] == 2
    assert reduced["Avg number of descriptors"] == 4.0
    assert reduced["Avg xfer time (ms)"] == 3.0
    assert reduced["Num failed transfers"] == 1
    assert reduced["Num expired leases"] == 0
    old = worker0.clone_and_reset()
    assert worker0.is_empty() and old.num_transfers == 1


def test_failures_alone_are_not_empty():
    stats = PdxferStats()
    stats.record_expired_leases(2)
    assert not stats.is_empty()
    assert stats.reduce() == {
        "Num successful transfers": 0,
        "Num failed transfers": 0,
        "Num expired leases": 2,
        "Num verify failures": 0,
    }
    stats.record_verify_failure()
    assert stats.reduce()["Num verify failures"] == 1


def test_prometheus_metrics_appear_under_their_names():
    registry = CollectorRegistry()
    types = {
        kind: functools.partial(kind, registry=registry) for kind in (Gauge, Counter, Histogram)
    }
    config = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="PdxferConnector",
            kv_connector_module_path="transfer.vllm",
            kv_role="kv_both",
        )
    )
    metrics = PdxferConnector.build_prom_metrics(config, types, ["engine"], {0: ["0"]})
    stats = PdxferStats()
    stats.record_transfer(500_000, 3, 0.0015)
    stats.record_transfer(700_000, 4, 0.0025)
    stats.record_failed_transfer()
    stats.record_expired_leases(1)
    stats.record_verify_failure()
    metrics.observe(stats.data, engine_idx=0)
    text = generate_latest(registry).decode()
    assert 'vllm:pdxfer_bytes_transferred_count{engine="0"} 2.0' in text
    assert 'vllm:pdxfer_bytes_transferred_sum{engine="0"} 1.2e+06' in text
    assert 'vllm:pdxfer_num_descriptors_sum{engine="0"} 7.0' in text
    assert 'vllm:pdxfer_xfer_time_seconds_bucket{engine="0",le="0.001"} 0.0' in text
    assert 'vllm:pdxfer_xfer_time_seconds_bucket{engine="0",le="0.0025"} 2.0' in text
    assert 'vllm:pdxfer_num_failed_transfers_total{engine="0"} 1.0' in text
    assert 'vllm:pdxfer_num_expired_leases_total{engine="0"} 1.0' in text
    assert 'vllm:pdxfer_num_verify_failures_total{engine="0"} 1.0' in text
