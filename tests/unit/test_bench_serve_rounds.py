"""Rounds of `bench serve` combine into one figure per level: medians, sums, step-weighted
means, and ratios taken within each round."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from transfer.bench.serve_rounds import combine_rounds, throughput_ratios


def _round(rate: float, ttft: tuple[float, float], steps: int, batch: float, step_ms: float,
           digest: str, concurrency: int = 32) -> dict:  # fmt: skip
    return {
        "concurrency": concurrency, "requests": 10, "failed": 1, "retries": 2,
        "output_tokens": 300, "wall_s": 300 / rate, "output_tokens_per_s": rate,
        "ttft_ms": {"p50": ttft[0], "p99": ttft[1]}, "itl_ms": {"p50": 30.0, "p99": 90.0},
        "e2e_ms": {"p50": 900.0, "p99": 1500.0}, "transfer_ms": {"p50": 0.5, "p99": 5.0},
        "exposed_transfer_ms": {"p50": 30.0, "p99": 60.0}, "prompt_tokens": 640,
        "cached_prompt_tokens": 0, "reused_decode_tokens": 0, "kv_bytes": 7, "state_bytes": 5,
        "output_digest": digest, "decode_steps": steps, "decode_batch_mean": batch,
        "decode_step_ms_mean": step_ms,
    }  # fmt: skip


def test_one_round_comes_back_as_it_is():
    one = _round(500.0, (200.0, 700.0), 100, 20.0, 33.0, "a" * 64)
    assert combine_rounds([one]) == one


def test_rounds_combine_into_medians_sums_and_step_weighted_means():
    rounds = [
        _round(600.0, (250.0, 900.0), 100, 20.0, 30.0, "a" * 64),
        _round(450.0, (300.0, 700.0), 300, 24.0, 40.0, "b" * 64),
        _round(700.0, (200.0, 800.0), 100, 16.0, 20.0, "c" * 64),
    ]
    out = combine_rounds(rounds)
    assert out["output_tokens_per_s"] == 600.0
    assert out["ttft_ms"] == {"p50": 250.0, "p99": 800.0}  # each percentile's own median
    assert (out["requests"], out["failed"], out["retries"]) == (30, 3, 6)
    assert (out["output_tokens"], out["kv_bytes"], out["decode_steps"]) == (900, 21, 500)
    assert out["wall_s"] == pytest.approx(sum(r["wall_s"] for r in rounds), abs=1e-3)
    assert out["decode_batch_mean"] == pytest.approx((2000 + 7200 + 1600) / 500)
    assert out["decode_step_ms_mean"] == pytest.approx((3000 + 12000 + 2000) / 500)
    assert [r["output_tokens_per_s"] for r in out["rounds"]] == [600.0, 450.0, 700.0]
    assert out["output_digest"] not in {"a" * 64, "b" * 64, "c" * 64}
    swapped = combine_rounds([rounds[1], rounds[0], rounds[2]])
    assert swapped["output_digest"] != out["output_digest"]  # the rounds' order counts
    assert rounds[0]["output_tokens_per_s"] == 600.0  # inputs untouched


def test_rounds_of_different_levels_are_refused():
    with pytest.raises(ValueError, match="different concurrencies"):
        combine_rounds([_round(1.0, (1, 2), 1, 1, 1, "a", 1), _round(1.0, (1, 2), 1, 1, 1, "a")])
    with pytest.raises(ValueError, match="no rounds"):
        combine_rounds([])


@given(st.lists(st.tuples(st.floats(1, 1e4), st.floats(1, 1e4)), min_size=1, max_size=7))
def test_ratios_are_taken_within_each_round(pairs):
    rounds = [
        [{"concurrency": 1, "output_tokens_per_s": a}, {"concurrency": 32, "output_tokens_per_s": b}]
        for a, b in pairs
    ]  # fmt: skip
    ratios = throughput_ratios(rounds)
    assert list(ratios) == ["32"]
    assert ratios["32"] == pytest.approx([b / a for a, b in pairs], abs=1e-3)
    # the median of paired ratios, not the ratio of medians
    assert statistics.median(ratios["32"]) == pytest.approx(
        statistics.median(b / a for a, b in pairs), abs=1e-3
    )


def test_one_level_has_no_ratios():
    assert throughput_ratios([[{"concurrency": 4, "output_tokens_per_s": 9.0}]]) == {}
