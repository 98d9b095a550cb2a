"""A KV connector's transfer totals, read from a vLLM server's Prometheus `/metrics`.

Both connectors export per-transfer histograms named `vllm:<prefix>_bytes_transferred`,
`vllm:<prefix>_num_descriptors` and `vllm:<prefix>_xfer_time_seconds` (prefix `nixl` or
`pdxfer`); a histogram's `_sum` is the total and its `_count` the number of transfers.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class ConnectorTotals:
    """Totals since the server started (sum over every label set, e.g. TP ranks/engines)."""

    transfers: int
    bytes: float
    descriptors: float
    xfer_seconds: float

    def __sub__(self, before: ConnectorTotals) -> ConnectorTotals:
        return ConnectorTotals(
            self.transfers - before.transfers,
            self.bytes - before.bytes,
            self.descriptors - before.descriptors,
            self.xfer_seconds - before.xfer_seconds,
        )


def histogram_sums(text: str, name: str) -> tuple[float, int]:
    """(sum, count) of histogram `name` in Prometheus text, over all its label sets; (0, 0)
    when the server exported none yet."""
    total, count = 0.0, 0
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == name + "_sum":
                total += sample.value
            elif sample.name == name + "_count":
                count += int(sample.value)
    return total, count


def connector_totals(text: str, prefix: str) -> ConnectorTotals:
    """The connector `prefix`'s totals in one `/metrics` text."""
    bytes_sum, transfers = histogram_sums(text, f"vllm:{prefix}_bytes_transferred")
    descriptors, _ = histogram_sums(text, f"vllm:{prefix}_num_descriptors")
    seconds, _ = histogram_sums(text, f"vllm:{prefix}_xfer_time_seconds")
    return ConnectorTotals(transfers, bytes_sum, descriptors, seconds)


def fetch_connector_totals(base_url: str, prefix: str, timeout_s: float = 10.0) -> ConnectorTotals:
    """`connector_totals` of the server at `base_url` now."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout_s) as response:
        return connector_totals(response.read().decode(), prefix)
