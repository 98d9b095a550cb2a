"""`pdxfer bench step`: one rank's prefill and decode steps timed in-process."""

import json
import subprocess
import sys

import pytest

from tests.support.launch import MAIN, ROOT


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", MAIN, "bench", "step", *args],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip


def test_times_a_prefill_then_decodes_of_it_per_batch_size():
    # Four prefills in a row on the same slots, then decodes past the prompt: any slot or
    # block left live, or a wrong context length, fails the step instead of timing it.
    result = bench(
        "--model", "tiny-qwen3.5", "--batch", "1,3", "--prompt-len", "20", "--steps", "2",
        "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["model"] == "tiny-qwen3.5"
    rows = report["results"]
    assert [(r["phase"], r["batch"], r["tokens"]) for r in rows] == [
        ("prefill", 1, 20), ("decode", 1, 1), ("prefill", 3, 20), ("decode", 3, 1),
    ]  # fmt: skip
    for r in rows:
        assert r["steps"] == 2
        assert 0 < r["min_ms"] <= r["p50_ms"]
        expected = r["batch"] * r["tokens"] / (r["p50_ms"] / 1e3)
        assert r["tokens_per_s"] == pytest.approx(expected, rel=0.01)
    assert result.stderr.count("bench step: ") == 4  # a progress line per measured series


@pytest.mark.parametrize(
    "flag, value",
    [("--batch", "1,x"), ("--batch", "0"), ("--prompt-len", "0"), ("--steps", "0")],
)
def test_bad_flags_are_named(flag, value):
    result = bench(flag, value)
    assert result.returncode == 2
    assert flag in result.stderr
