"""One entry of `pdxfer bench transfer`'s results: a token count's timed modes, as medians,
p99s, GB/s, descriptor counts and the ratios between modes."""

from __future__ import annotations

import numpy as np

from transfer.bench.transfer_setup import Transfers
from transfer.stats import percentile

MODES = ("ours", "lowest", "raw", "naive", "stream", "groups")
STREAM_MODES = ("stream", "groups")  # layer-wise: posted as groups get ready / all at once


def summarize(
    tokens: int, transfers: Transfers, times: dict[str, list[float]], p_tp: int, d_tp: int
) -> dict:
    """One entry of the report's `results`."""
    entry: dict = {
        "prefill_tp": p_tp,
        "decode_tp": d_tp,
        "tokens": tokens,
        "bytes": transfers.bytes,
    }
    entry["kv_bytes"] = sum(plan.kv_bytes for plan in transfers.ours)
    entry["state_bytes"] = sum(plan.state_bytes for plan in transfers.ours)
    for mode in MODES:
        if mode not in times or mode in STREAM_MODES:
            continue
        prefix = "" if mode == "ours" else f"{mode}_"
        median = float(np.median(times[mode]))
        entry[f"{prefix}median_ms"] = median * 1e3
        entry[f"{prefix}p99_ms"] = percentile(times[mode], 99) * 1e3
        entry[f"{prefix}gbps"] = transfers.nbytes(mode) / median / 1e9
        entry[f"{prefix}descriptors"] = transfers.count(mode)
        if mode != "ours":
            entry[f"{prefix}bytes"] = transfers.nbytes(mode)
    entry["efficiency"] = entry["gbps"] / entry["raw_gbps"]
    entry["speedup"] = entry["gbps"] / entry["naive_gbps"]
    if "lowest" in times:
        entry["lowest_efficiency"] = entry["lowest_gbps"] / entry["raw_gbps"]
    entry["staged_sources"] = sum(
        s.mode.value != "direct" for plan in transfers.ours for s in plan.sources
    )
    if "stream" in times:
        entry.update(_stream_entry(transfers, times))
    entry["verified"] = True
    return entry


def _stream_entry(transfers: Transfers, times: dict[str, list[float]]) -> dict:
    """Layer-wise streaming against the whole request (ours), both timed in this run."""
    exposed = float(np.median(times["stream"]))
    whole = float(np.median(times["ours"]))  # posted once the prefill ended: all exposed
    groups = float(np.median(times["groups"]))
    raw_gbps = transfers.nbytes("raw") / float(np.median(times["raw"])) / 1e9
    return {
        "exposed_ms": exposed * 1e3,
        "exposed_p99_ms": percentile(times["stream"], 99) * 1e3,
        "whole_exposed_ms": whole * 1e3,
        "exposed_ratio": exposed / whole,
        "prefill_ms": transfers.stream_ready_s[-1] * 1e3,
        "stream_groups": len({part.layers for part in transfers.stream_parts}),
        "stream_parts": len(transfers.stream),
        "stream_descriptors": transfers.stream_descriptors,
        "groups_median_ms": groups * 1e3,
        "groups_gbps": transfers.stream_bytes / groups / 1e9,
        "groups_efficiency": transfers.stream_bytes / groups / 1e9 / raw_gbps,
    }
