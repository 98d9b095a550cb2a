"""Rounds of `bench serve`: every concurrency level run R times in turn, each round with
fresh prompts, and one figure per level from its rounds.

This box's speed drifts by tens of percent within minutes, so one pass over the levels can
catch C=1 in a fast spell and C=32 in a slow one. Rounds interleave the levels in time; a
level's throughput is the median of its rounds, and a ratio between two levels is taken
within each round (levels minutes apart never meet in one ratio)."""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Sequence

LATENCY_KEYS = ("ttft_ms", "itl_ms", "e2e_ms", "transfer_ms", "exposed_transfer_ms")
# CPU per generated token is reported for each: the decode instance with its ranks, the
# decode instance's own process (engine, gRPC, transfer control; no forward), the router.
CPU_SIDES = ("decode", "decode_control", "router")
SUMMED_KEYS = (
    "requests", "failed", "retries", "output_tokens", "prompt_tokens", "cached_prompt_tokens",
    "reused_decode_tokens", "kv_bytes", "state_bytes", "decode_steps",
    *(f"{side}_cpu_s" for side in CPU_SIDES),
)  # fmt: skip


def combine_rounds(rounds: Sequence[dict]) -> dict:
    """One level's result from its rounds (each a `LoadResult.to_dict()` plus the decode
    step figures). One round comes back as it is. Otherwise: throughput and each latency
    percentile are the medians over rounds; counts and wall time are summed; the mean batch
    size and step time are over all steps; `rounds` keeps each round's throughput, wall
    time and digest, and `output_digest` covers every round's tokens in order."""
    if not rounds:
        raise ValueError("combine_rounds: no rounds")
    if len(rounds) == 1:
        return dict(rounds[0])
    levels = {r["concurrency"] for r in rounds}
    if len(levels) != 1:
        raise ValueError(f"combine_rounds: rounds of different concurrencies {sorted(levels)}")
    out = dict(rounds[0])
    for key in SUMMED_KEYS:
        if key in out:
            out[key] = sum(r[key] for r in rounds)
    out["wall_s"] = round(sum(r["wall_s"] for r in rounds), 3)
    out["output_tokens_per_s"] = round(
        statistics.median(r["output_tokens_per_s"] for r in rounds), 3
    )
    for key in LATENCY_KEYS:
        if key in out:
            out[key] = {
                p: round(statistics.median(r[key][p] for r in rounds), 3) for p in ("p50", "p99")
            }
    steps = out.get("decode_steps", 0)
    for key in ("decode_batch_mean", "decode_step_ms_mean"):
        if key in out:
            weighted = sum(r[key] * r["decode_steps"] for r in rounds)
            out[key] = round(weighted / steps, 3) if steps else 0.0
    digest = hashlib.sha256()
    for r in rounds:
        digest.update(r["output_digest"].encode())
    out["output_digest"] = digest.hexdigest()
    out["rounds"] = [
        {key: r[key] for key in ("output_tokens_per_s", "wall_s", "output_digest")} for r in rounds
    ]
    return out


def throughput_ratios(rounds: Sequence[Sequence[dict]]) -> dict[str, list[float]]:
    """rounds[i][j]: round i's result at level j (levels in the same order every round).
    For each level after the first, its throughput over the first level's, round by round:
    {"32": [ratio of round 0, ...]}. Empty with fewer than two levels."""
    ratios: dict[str, list[float]] = {}
    for results in rounds:
        base = results[0]["output_tokens_per_s"]
        for r in results[1:]:
            ratio = r["output_tokens_per_s"] / base if base > 0 else 0.0
            ratios.setdefault(str(r["concurrency"]), []).append(round(ratio, 3))
    return ratios
