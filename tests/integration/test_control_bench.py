"""`pdxfer bench control` runs end to end on a small load and leaves no ticket behind (no timing asserted)."""

from __future__ import annotations

import argparse
import json

import pytest

from transfer.bench import control


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    control.register(parser.add_subparsers(dest="bench", required=True))
    return parser.parse_args(argv)


@pytest.mark.slow
def test_bench_control_reports_both_phases(capsys):
    assert control.run(parse(["control", "--tickets", "30", "--concurrency", "3", "--json"])) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["leaked"] == 0 and (result["tickets"], result["concurrency"]) == (30, 3)
    for phase in ("serial", "loaded"):
        summary = result[phase]
        assert (
            0 < summary["p50_ms"] <= summary["p99_ms"]
            and summary["rpcs_per_s"] == 2 * summary["tickets_per_s"]
        )


@pytest.mark.parametrize(
    ("argv", "field"),
    [(["--tickets", "0"], "--tickets"), (["--concurrency", "-1"], "--concurrency")],
)
def test_bench_control_rejects_bad_arguments(argv, field):
    with pytest.raises(ValueError, match=field):
        control.run(parse(["control", *argv]))
