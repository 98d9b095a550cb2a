"""`pdxfer bench transfer` end to end on tiny sizes: real rank processes, real transports.

Timing is never asserted; the shape of the report, the byte counts of the three modes and
the benchmark's own byte verification (it fails the run on a checksum mismatch) are.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys

import pytest

from transfer.cli import main

RESULT_KEYS = {
    "tokens": int,
    "bytes": int,
    "gbps": float,
    "raw_gbps": float,
    "naive_gbps": float,
    "efficiency": float,
    "speedup": float,
    "descriptors": int,
    "naive_descriptors": int,
}


# A hang guard, not a speed check: 11-20 s alone, over 240 s once beside two vLLM servers.
def _bench(*args: str, timeout: float = 480) -> subprocess.CompletedProcess:
    entry = "import sys; from transfer.cli import main; sys.exit(main())"
    argv = [sys.executable, "-c", entry, "bench", "transfer", "--repeats", "2", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def _check_results(report: dict, tokens: list[int]) -> None:
    assert [r["tokens"] for r in report["results"]] == tokens
    for result in report["results"]:
        for key, kind in RESULT_KEYS.items():
            assert isinstance(result[key], kind), (key, result[key])
        assert result["bytes"] == result["raw_bytes"] == result["naive_bytes"] > 0
        assert result["verified"] is True
        assert result["raw_descriptors"] <= result["descriptors"] < result["naive_descriptors"]
        # The old allocator's request, timed side by side (fewer runs is not promised on
        # tiny sizes, where staging may gather the lowest-first request's many pieces).
        assert result["lowest_bytes"] == result["bytes"]
        assert isinstance(result["lowest_gbps"], float) and result["lowest_descriptors"] >= 1
        assert result["prefill_block_runs"] <= result["lowest_prefill_block_runs"]


def _check_layerwise(report: dict, groups: int, full_prefill_ms: list[float]) -> None:
    """Layer-wise keys: the stream's groups, its exposed time against the whole request's
    (same run), and the modelled prefill (the scaled model's share of the full one)."""
    assert report["stream_layers"] > 0 and report["prefill_tokens_per_s"] > 0
    for result, full_ms in zip(report["results"], full_prefill_ms, strict=True):
        assert result["stream_groups"] == result["stream_parts"] == groups  # one chunk
        assert result["stream_descriptors"] >= groups
        assert result["exposed_ms"] >= 0 and result["whole_exposed_ms"] > 0
        assert result["exposed_ratio"] == pytest.approx(
            result["exposed_ms"] / result["whole_exposed_ms"]
        )
        assert 0 < result["prefill_ms"] <= full_ms + 1e-9
        assert result["groups_gbps"] > 0 and result["groups_efficiency"] > 0


@pytest.mark.slow
def test_loopback_tiny_hetero_tp(tmp_path):
    csv_path, png_path = tmp_path / "t.csv", tmp_path / "t.png"
    # A cap below the full tiny model's arenas: the benchmark must scale layers and say so.
    done = _bench(
        "--model",
        "tiny-qwen3-next",
        "--tokens",
        "256,1024",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "1",
        "--max-arena-bytes",
        "5MB",
        "--control-tickets",
        "20",
        "--control-concurrency",
        "2",
        "--json",
        "--csv",
        str(csv_path),
        "--plot",
        str(png_path),
        "--layerwise",
        "--stream-layers",
        "2",
        "--prefill-tokens-per-s",
        "100000",
        "--stream-chunk-tokens",
        "2048",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["layers"] < report["model_layers"] == 8
    # The scaled model keeps its leading layers: they get only their share of the prefill.
    groups = len({layer // 2 for layer in range(report["layers"])})
    _check_layerwise(report, groups, [256 / 100, 1024 / 100])
    assert report["results"][0]["prefill_ms"] < 256 / 100
    assert f"scaled tiny-qwen3-next from 8 to {report['layers']} layers" in done.stderr
    assert sum(report["arena_bytes"].values()) <= 5_000_000
    _check_results(report, [256, 1024])
    assert report["control"]["tickets_per_s"] > 0 and report["control"]["p99_ms"] > 0
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["tokens"]) for r in rows] == [256, 1024]
    assert png_path.stat().st_size > 0


def _can_netns() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "needs iproute2"
    return None


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("pdx-")}


@pytest.mark.slow
@pytest.mark.skipif(_can_netns() is not None, reason=str(_can_netns()))
def test_netns_tiny_replicated_mla():
    before = _namespaces()
    done = _bench(
        "--model",
        "tiny-kimi-linear",
        "--tokens",
        "256",
        "--tp-pairs",
        "1:2",
        "--nodes",
        "netns",
        "--control-tickets",
        "0",
        "--json",
        "--layerwise",
        "--stream-layers",
        "3",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert (report["nodes"], report["tls"]) == ("netns", "tcp")
    _check_results(report, [256])
    _check_layerwise(report, 3, [256 / 50])  # 8 layers in groups of 3; 50k tokens/s
    assert report["results"][0]["prefill_ms"] == pytest.approx(256 / 50)
    assert "control" not in report
    assert not _namespaces() - before


def test_netns_without_root_says_so(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    code = main(["bench", "transfer", "--model", "tiny-qwen3-next", "--nodes", "netns"])
    assert code == 2
    assert "needs root" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, field",
    [
        (["--tokens", "1k,x"], "--tokens"),
        (["--tokens", "0"], "--tokens"),
        (["--tp-pairs", "2-1"], "--tp-pairs"),
        (["--decode-tp", "3"], "decode_tp 3"),
        (["--repeats", "0"], "repeats"),
        (["--max-arena-bytes", "lots"], "--max-arena-bytes"),
        (["--layerwise", "--stream-layers", "-1"], "stream_layers"),
        (["--layerwise", "--prefill-tokens-per-s", "0"], "prefill_tokens_per_s"),
        (["--layerwise", "--stream-chunk-tokens", "-5"], "stream_chunk_tokens"),
    ],
)
def test_bad_input_names_the_field(args, field, capsys):
    code = main(["bench", "transfer", "--model", "tiny-qwen3-next", *args])
    assert code == 2
    assert field in capsys.readouterr().err
