"""`pdxfer bench serve`: a real P/D pair under closed-loop load, reported per concurrency."""

import json
import subprocess
import sys

import pytest

from tests.support.launch import MAIN, ROOT
from transfer.trace import TracePoint


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", MAIN, "bench", "serve", *args],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.slow
def test_reports_every_concurrency_with_the_documented_keys(tmp_path):
    plot = tmp_path / "serve.png"
    result = bench(
        "--concurrency", "1,3", "--requests", "6", "--prompt-len", "20", "--max-tokens", "5",
        "--transfer-mode", "layerwise", "--stream-layers", "2", "--json", "--plot", str(plot),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["transfer_mode"] == "layerwise"  # three streams at once at concurrency 3
    assert [r["concurrency"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        assert r["failed"] == 0
        assert r["output_tokens"] == 6 * 5
        assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"], rel=0.01)
        for key in ("ttft_ms", "itl_ms", "e2e_ms", "transfer_ms", "exposed_transfer_ms"):
            assert r[key]["p50"] <= r[key]["p99"]
        assert r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]
        assert 0 < r["exposed_transfer_ms"]["p50"] <= r["ttft_ms"]["p50"]
        assert r["decode_cpu_ms_per_token"] > 0 and r["router_cpu_ms_per_token"] > 0
        # the decode process alone is part of its tree, which holds its rank's forwards
        assert 0 < r["decode_control_cpu_ms_per_token"] < r["decode_cpu_ms_per_token"]
        # each request decodes its 4 tokens after the prefill's first: 6 x 4 request-steps
        assert r["decode_steps"] * r["decode_batch_mean"] == pytest.approx(6 * 4, abs=0.15)
        assert r["decode_step_ms_mean"] > 0
    assert report["results"][0]["decode_batch_mean"] == 1.0  # one request at a time
    assert plot.stat().st_size > 0


@pytest.mark.parametrize("flag, value", [("--concurrency", "1,x"), ("--concurrency", "0"),
                                         ("--requests", "0"), ("--rounds", "0"),
                                         ("--stream-layers", "0"),
                                         ("--transfer-mode", "push")])  # fmt: skip
def test_bad_flags_are_named(flag, value):
    result = bench(flag, value)
    assert result.returncode == 2
    assert flag in result.stderr


@pytest.mark.slow
def test_rounds_interleave_the_levels_with_fresh_prompts():
    result = bench(
        "--concurrency", "1,2", "--requests", "4", "--prompt-len", "16", "--max-tokens", "4",
        "--rounds", "2", "--trace", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["rounds"] == 2
    assert [r["concurrency"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert (r["requests"], r["failed"], r["output_tokens"]) == (8, 0, 8 * 4)
        rates = [x["output_tokens_per_s"] for x in r["rounds"]]
        assert len(rates) == 2 and r["output_tokens_per_s"] == pytest.approx(
            sum(rates) / 2, abs=1e-3
        )
        digests = [x["output_digest"] for x in r["rounds"]]
        assert digests[0] != digests[1]  # each round drew its own prompts
    (ratios,) = report["throughput_ratios"].values()
    first, second = ([x["output_tokens_per_s"] for x in r["rounds"]] for r in report["results"])
    assert ratios == pytest.approx([b / a for a, b in zip(first, second, strict=True)], abs=1e-3)
    # round by round, in the order: 1, 2, 1, 2
    rounds = [line for line in result.stderr.splitlines() if "(round " in line]
    assert [line.split(":")[1].strip()[:22] for line in rounds] == [
        "concurrency 1 (round 1", "concurrency 2 (round 1", "concurrency 1 (round 2",
        "concurrency 2 (round 2",
    ]  # fmt: skip
    for r in report["results"]:
        assert_hops_follow_the_path(r["hops_ms"], requests=8, ttft_p50_ms=r["ttft_ms"]["p50"])


SIDE_BY_SIDE = {("acquire_received", "transfer_started"), ("transfer_done", "acquire_answered")}


def assert_hops_follow_the_path(hops: list[dict], requests: int, ttft_p50_ms: float) -> None:
    """Every request of the level passed every point, in the path's order, on one clock."""
    order = [p.value for p in TracePoint]
    path = [(h["start"], h["end"]) for h in hops[: len(order) - 1]]
    assert path == list(zip(order, order[1:], strict=False))
    for hop in hops:
        assert hop["count"] == requests, hop
        assert hop["min_ms"] <= hop["p50_ms"] <= hop["p90_ms"] <= hop["max_ms"]
        # a whole ticket's READs run beside the Acquire: they may start before prefill has
        # seen it, and land before or after its answer
        if (hop["start"], hop["end"]) not in SIDE_BY_SIDE:
            assert hop["min_ms"] >= 0, hop
    spans = {(h["start"], h["end"]): h for h in hops[len(order) - 1 :]}
    assert set(spans) == {
        ("prefill_done", "first_token"),
        ("router_received", "router_first_token"),
    }
    # the router saw each request's first token no later than its client did
    assert spans["router_received", "router_first_token"]["p50_ms"] <= ttft_p50_ms


@pytest.mark.slow
def test_multiturn_conversations_resend_their_turns_and_hit_both_caches():
    # 2 conversations of 3 turns; a turn resends the last prompt, its 4 answer tokens and
    # 20 new ones: 200 + 224 + 248 prompt tokens each. Blocks are 128 tokens here, so every
    # later turn restores the checkpoint at 128 and decode holds that block already.
    result = bench(
        "--concurrency", "2", "--requests", "6", "--workload", "multiturn", "--turns", "3",
        "--prompt-len", "200", "--system-len", "160", "--turn-len", "20", "--max-tokens", "4",
        "--prefix-cache", "--checkpoint-interval", "128", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert (report["workload"], report["prefix_cache"]) == ("multiturn", True)
    (r,) = report["results"]
    assert (r["requests"], r["failed"], r["output_tokens"]) == (6, 0, 6 * 4)
    assert r["prompt_tokens"] == 2 * (200 + 224 + 248)
    assert r["cached_prompt_tokens"] >= 4 * 128
    assert r["reused_decode_tokens"] >= 4 * 128
    assert len(r["output_digest"]) == 64
