"""Summary statistics shared by the benchmarks and reports."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], p: float, *, interpolate: bool = False) -> float:
    """The `p`-th percentile (0..100) of `values`: nearest rank, or linear interpolation
    between the two closest ranks with `interpolate`. ValueError when `values` is empty."""
    if not values:
        raise ValueError("percentile: no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile: p must be in [0, 100], got {p}")
    ordered = sorted(values)
    if not interpolate:
        return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]
    pos = p / 100 * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
