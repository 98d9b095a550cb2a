"""`pdxfer bench transport` runs end to end and checks its own bytes (no timing asserted)."""

import json

import pytest

from transfer.cli import main

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", ["nixl", "ucx"])
def test_bench_transport_reports_both_series(backend, capsys):
    argv = ["bench", "transport", "--backend", backend, "--size", "2MiB", "--ranges", "300"]
    assert main([*argv, "--repeats", "2", "--op", "write", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verified"] and result["op"] == "WRITE"
    assert result["ranges"]["ranges"] == 300 and result["ceiling"]["ranges"] == 1
    assert result["size_bytes"] == 300 * (2 * 2**20 // 300)
    for series in (result["ranges"], result["ceiling"]):
        assert len(series["gbps"]) == 2
        assert series["min_gbps"] <= series["median_gbps"] <= series["max_gbps"]


def test_bench_transport_rejects_bad_sizes(capsys):
    assert main(["bench", "transport", "--size", "100", "--ranges", "101"]) == 2
    assert "--ranges" in capsys.readouterr().err
