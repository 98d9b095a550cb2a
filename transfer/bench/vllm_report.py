"""`pdxfer bench vllm`'s table: per connector and TP pair, what moved per request, TTFT and
whether the tokens equal a colocated run's; then PdxferConnector / NixlConnector ratios."""

from __future__ import annotations

from transfer.bench.vllm_pd import ConnectorRun
from transfer.serving.launch.vllm_servers import Connector
from transfer.stats import percentile

HEADER = (f"{'pair':5s} {'connector':9s} {'transfers':>9s} {'MB/req':>8s} {'desc/req':>9s} "
          f"{'xfer ms/req':>11s} {'TTFT p50':>9s} {'TTFT p99':>9s}  tokens")  # fmt: skip


def _per_request(run: ConnectorRun) -> tuple[float, float, float]:
    n = len(run.ttfts)
    totals = run.totals
    return totals.bytes / n / 1e6, totals.descriptors / n, totals.xfer_seconds / n * 1e3


def row(run: ConnectorRun) -> str:
    pair = f"{run.prefill_tp}->{run.decode_tp}"
    if run.error is not None or run.totals is None or not run.ttfts:
        return f"{pair:5s} {run.connector.value:9s} failed: {run.error}"
    mb, descriptors, xfer_ms = _per_request(run)
    p50 = percentile(run.ttfts, 50) * 1e3
    p99 = percentile(run.ttfts, 99) * 1e3
    tokens = "equal to colocated" if run.equal_to_colocated else "DIFFER from colocated"
    return (f"{pair:5s} {run.connector.value:9s} {run.totals.transfers:9d} {mb:8.3f} "
            f"{descriptors:9.1f} {xfer_ms:11.2f} {p50:7.0f}ms {p99:7.0f}ms  {tokens}")  # fmt: skip


def _ratio(value: float) -> str:
    """Three decimals, or two significant digits below 0.01 (a ratio is never printed as 0)."""
    return f"{value:.3f}" if value >= 0.01 else f"{value:.2g}"


def ratios(runs: list[ConnectorRun]) -> list[str]:
    """pdxfer / nixl at each TP pair where both ran."""
    lines = []
    done = {(r.connector, r.prefill_tp, r.decode_tp): r for r in runs if r.error is None}
    for (connector, p, d), pdx in sorted(done.items(), key=lambda kv: kv[0][1:]):
        nixl = done.get((Connector.NIXL, p, d))
        if connector is not Connector.PDXFER or nixl is None or not (pdx.ttfts and nixl.ttfts):
            continue
        a, b = _per_request(pdx), _per_request(nixl)
        parts = [f"{name} {_ratio(x / y)}x" if y else f"{name} n/a"
                 for name, x, y in zip(("bytes", "descriptors", "transfer time"), a, b,
                                       strict=True)]  # fmt: skip
        ttft = percentile(pdx.ttfts, 50) / percentile(nixl.ttfts, 50)
        same = "equal" if pdx.tokens == nixl.tokens else "DIFFERENT"
        lines.append(f"{p}->{d} pdxfer/nixl: {', '.join(parts)}, TTFT p50 {_ratio(ttft)}x; "
                     f"tokens {same} between connectors")  # fmt: skip
    return lines


def report(runs: list[ConnectorRun]) -> str:
    return "\n".join([HEADER, *map(row, runs), *ratios(runs)])
