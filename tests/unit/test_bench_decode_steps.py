"""`bench serve` reads how full the decode batches were from the decode instance's /metrics:
the step histograms' totals before and after a concurrency level."""

from __future__ import annotations

import pytest

from transfer.bench.decode_steps import parse_step_totals, read_step_totals
from transfer.control.metrics import WorkerMetrics, serve_metrics


def test_the_steps_between_two_readings_give_their_mean_batch_and_time():
    metrics = WorkerMetrics()
    metrics.record_decode_step(4, 0.010)
    page = metrics.render().decode()
    before = parse_step_totals(page)
    for size, seconds in ((32, 0.030), (16, 0.020), (9, 0.016)):
        metrics.record_decode_step(size, seconds)
    after = parse_step_totals(metrics.render().decode())
    assert after.since(before) == {
        "decode_steps": 3,
        "decode_batch_mean": 19.0,
        "decode_step_ms_mean": 22.0,
    }
    assert after.since(after)["decode_steps"] == 0


def test_a_page_without_the_step_histograms_is_named():
    with pytest.raises(ValueError, match="pdxfer_batch_size_count"):
        parse_step_totals("# a router's page\nother_metric 1.0\n")


def test_scraped_over_http_from_a_local_instance():
    metrics = WorkerMetrics()
    metrics.record_decode_step(8, 0.004)
    server = serve_metrics(metrics, host="127.0.0.1")
    try:
        totals = read_step_totals(server.port)
    finally:
        server.stop()
    assert (totals.steps, totals.requests) == (1, 8.0)
