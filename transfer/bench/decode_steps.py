"""How full a decode instance's batches were over a span of load, from its /metrics: the
`pdxfer_batch_size` and `pdxfer_step_seconds` histograms read before and after."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class StepTotals:
    """Running totals of one decode instance: steps, requests over all steps, step seconds."""

    steps: int
    requests: float
    seconds: float

    def since(self, before: StepTotals) -> dict:
        """What the steps between `before` and this reading did: their count, mean batch
        size and mean wall time (ms); zeros when none ran."""
        steps = self.steps - before.steps
        if steps <= 0:
            return {"decode_steps": 0, "decode_batch_mean": 0.0, "decode_step_ms_mean": 0.0}
        return {
            "decode_steps": steps,
            "decode_batch_mean": round((self.requests - before.requests) / steps, 2),
            "decode_step_ms_mean": round(1e3 * (self.seconds - before.seconds) / steps, 3),
        }


def parse_step_totals(text: str) -> StepTotals:
    """The step histograms' `_count` and `_sum` samples of a /metrics page; ValueError
    naming the metric when one is missing."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name] = sample.value
    names = ("pdxfer_batch_size_count", "pdxfer_batch_size_sum", "pdxfer_step_seconds_sum")
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"/metrics: no {', '.join(missing)} (not a decode instance's page?)")
    return StepTotals(int(found[names[0]]), found[names[1]], found[names[2]])


def read_step_totals(port: int, timeout_s: float = 10.0) -> StepTotals:
    """Scrape http://127.0.0.1:`port`/metrics (a local decode instance's)."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return parse_step_totals(reply.read().decode())
