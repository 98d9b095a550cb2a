"""WorkerMetrics: the public names, pool gauges read at scrape time, per-worker registries, the HTTP endpoint."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from transfer.control import ControlConfig, TicketStore, WorkerMetrics, serve_metrics

PUBLIC = {
    "pdxfer_kv_blocks_free",
    "pdxfer_kv_blocks_total",
    "pdxfer_state_slots_free",
    "pdxfer_state_slots_total",
    "pdxfer_tickets_active",
    "pdxfer_leases_expired_total",
    "pdxfer_transfers_total",
    "pdxfer_transfer_bytes_total",
    "pdxfer_transfer_descriptors_total",
    "pdxfer_transfer_seconds_bucket",
    "pdxfer_transfer_seconds_count",
    "pdxfer_transfer_seconds_sum",
    "pdxfer_transfer_exposed_seconds_count",
}


def samples(text: bytes | str) -> dict[tuple[str, tuple], float]:
    text = text.decode() if isinstance(text, bytes) else text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_public_names_and_values():
    metrics = WorkerMetrics()
    free = {"blocks": 10, "slots": 3}
    metrics.track_pools(
        kv_blocks_free=lambda: free["blocks"],
        kv_blocks_total=lambda: 16,
        state_slots_free=lambda: free["slots"],
        state_slots_total=lambda: 4,
    )
    metrics.record_transfer("done", 0.003, {"kv": 4096, "state": 1024}, 5, exposed_s=0.001)
    metrics.record_transfer("failed", 0.2)
    free["blocks"] = 12
    got = samples(metrics.render())
    assert {name for name, _ in got} >= PUBLIC
    assert got[("pdxfer_kv_blocks_free", ())] == 12 and got[("pdxfer_state_slots_total", ())] == 4
    assert got[("pdxfer_transfers_total", (("status", "done"),))] == 1
    assert got[("pdxfer_transfers_total", (("status", "failed"),))] == 1
    assert got[("pdxfer_transfer_bytes_total", (("kind", "kv"),))] == 4096
    assert got[("pdxfer_transfer_descriptors_total", ())] == 5
    assert got[("pdxfer_transfer_seconds_count", ())] == 2
    assert got[("pdxfer_transfer_seconds_bucket", (("le", "0.005"),))] == 1
    assert got[("pdxfer_transfer_exposed_seconds_count", ())] == 1  # a failed one exposes none


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("", 0.1), "status"),
        (("done", -1.0), "seconds"),
        (("done", 0.1, {"kv": -1}), "bytes_by_kind"),
        (("done", 0.1, {}, 0, -0.5), "exposed_s"),
    ],
)
def test_record_transfer_rejects_bad_values(args, field):
    metrics = WorkerMetrics()
    with pytest.raises(ValueError, match=field):
        metrics.record_transfer(*args)
    got = samples(metrics.render())
    assert got[("pdxfer_transfer_seconds_count", ())] == 0
    assert not [
        key for key in got if key[0] in ("pdxfer_transfers_total", "pdxfer_transfer_bytes_total")
    ]


def test_store_feeds_ticket_metrics_and_workers_do_not_collide():
    clock = [0.0]
    first, second = WorkerMetrics(), WorkerMetrics()  # two workers in one process
    store = TicketStore(
        ControlConfig(8, 4, 1, 2, lease_s=1.0),
        lambda t, r: None,
        clock=lambda: clock[0],
        metrics=first,
    )
    store.publish("a", [0], 0, 1, 1)
    store.publish("b", [1], 1, 1, 1)
    assert samples(first.render())[("pdxfer_tickets_active", ())] == 2
    clock[0] = 5.0
    store.reap()
    got = samples(first.render())
    assert got[("pdxfer_tickets_active", ())] == 0 and got[("pdxfer_leases_expired_total", ())] == 2
    assert samples(second.render())[("pdxfer_leases_expired_total", ())] == 0


def test_metrics_endpoint_serves_the_worker_registry():
    metrics = WorkerMetrics()
    metrics.transfer_descriptors.inc(3)
    server = serve_metrics(metrics, host="127.0.0.1", port=0)
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{server.port}/metrics", timeout=10
        ) as response:
            body = response.read()
    finally:
        server.stop()
    assert samples(body)[("pdxfer_transfer_descriptors_total", ())] == 3


def test_block_runs_are_recorded_per_request():
    metrics = WorkerMetrics()
    for runs in (1, 1, 5):
        metrics.record_block_runs(runs)
    text = metrics.render().decode()
    assert "pdxfer_kv_block_runs_count 3.0" in text
    assert "pdxfer_kv_block_runs_sum 7.0" in text
    assert 'pdxfer_kv_block_runs_bucket{le="1.0"} 2.0' in text
    assert "pdxfer_kv_block_runs_last 5.0" in text
    with pytest.raises(ValueError, match="runs"):
        metrics.record_block_runs(-1)


def test_scheduler_metrics_batch_sizes_step_times_and_request_gauges():
    metrics = WorkerMetrics()
    queue = {"running": 3, "waiting": 1}
    metrics.track_requests(running=lambda: queue["running"], waiting=lambda: queue["waiting"])
    for size, seconds in ((1, 0.004), (8, 0.02), (32, 0.06)):
        metrics.record_decode_step(size, seconds)
    queue["running"] = 7
    got = samples(metrics.render())
    assert got["pdxfer_requests_running", ()] == 7
    assert got["pdxfer_requests_waiting", ()] == 1
    assert got["pdxfer_batch_size_count", ()] == 3
    assert got["pdxfer_batch_size_sum", ()] == 41
    assert got["pdxfer_batch_size_bucket", (("le", "8.0"),)] == 2
    assert got["pdxfer_step_seconds_bucket", (("le", "0.025"),)] == 2
    for bad in ((0, 0.1), (True, 0.1), (2, -1.0)):
        with pytest.raises(ValueError):
            metrics.record_decode_step(*bad)
