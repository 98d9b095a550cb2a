"""Hop-by-hop latency from `transfer.trace`'s points: for each pair of consecutive points a
request passed, how long the step between them took, over the requests of one load."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise

from transfer.stats import percentile
from transfer.trace import TracePoint

ORDER = tuple(TracePoint)
# The spans worth one line each besides the hops: what TTFT saw after the prompt's cache was
# written (the exposed transfer, with the hops around it), and all of it.
SPANS = (
    (TracePoint.PREFILL_DONE, TracePoint.FIRST_TOKEN),
    (TracePoint.ROUTER_RECEIVED, TracePoint.ROUTER_FIRST_TOKEN),
)


@dataclass(frozen=True)
class Hop:
    """From `start` to `end` over `count` requests, in ms (negative: `end` came first)."""

    start: TracePoint
    end: TracePoint
    count: int
    p50_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float

    @property
    def name(self) -> str:
        return f"{self.start.value} -> {self.end.value}"

    def to_dict(self) -> dict:
        return asdict(self) | {"start": self.start.value, "end": self.end.value}


Traces = Mapping[str, Mapping[TracePoint, float]]


def in_window(traces: Traces, windows: Sequence[tuple[float, float]]) -> dict:
    """The requests the router took within one of `windows` ((start, end) unix seconds)."""
    return {
        rid: points
        for rid, points in traces.items()
        if TracePoint.ROUTER_RECEIVED in points
        and any(lo <= points[TracePoint.ROUTER_RECEIVED] < hi for lo, hi in windows)
    }


def hop_table(traces: Traces) -> list[Hop]:
    """Each hop between consecutive points of `ORDER` (a request that skipped a point
    counts in the hop over it), then each of `SPANS` that is not a hop already."""
    hops: dict[tuple[TracePoint, TracePoint], list[float]] = {}
    spans: dict[tuple[TracePoint, TracePoint], list[float]] = {span: [] for span in SPANS}
    for points in traces.values():
        passed = [p for p in ORDER if p in points]
        for start, end in pairwise(passed):
            hops.setdefault((start, end), []).append(points[end] - points[start])
        for start, end in SPANS:
            if start in points and end in points:
                spans[start, end].append(points[end] - points[start])
    ordered = sorted(hops, key=lambda pair: (ORDER.index(pair[0]), ORDER.index(pair[1])))
    return [_hop(*pair, hops[pair]) for pair in ordered] + [
        _hop(*span, seconds) for span, seconds in spans.items() if seconds and span not in hops
    ]


def _hop(start: TracePoint, end: TracePoint, seconds: list[float]) -> Hop:
    ms = [s * 1e3 for s in seconds]
    return Hop(
        start, end, len(ms), round(percentile(ms, 50), 3), round(percentile(ms, 90), 3),
        round(min(ms), 3), round(max(ms), 3),
    )  # fmt: skip


def format_hops(tables: Mapping[str, Sequence[Hop]]) -> str:
    """One line per hop, a "p50 / p90" column per table (`tables`: column title -> hops)."""
    titles = list(tables)
    names: list[str] = []
    cells: dict[tuple[str, str], str] = {}
    for title, hops in tables.items():
        for hop in hops:
            if hop.name not in names:
                names.append(hop.name)
            cells[hop.name, title] = f"{hop.p50_ms:.1f} / {hop.p90_ms:.1f}"
    width = max([len(n) for n in names] + [len("hop (ms, p50 / p90)")])
    lines = [f"{'hop (ms, p50 / p90)':<{width}} " + " ".join(f"{c:>15}" for c in titles)]
    for name in names:
        lines.append(
            f"{name:<{width}} " + " ".join(f"{cells.get((name, c), '-'):>15}" for c in titles)
        )
    return "\n".join(lines)
