"""The router's Prometheus metrics: its Generate outcomes and retries (`RouterMetrics`, the
registry), and the HTTP front end's latency histograms and cancel counter on it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    """The router's own Prometheus registry (it holds no cache, so no pool gauges)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdxfer_router_requests",
            "Generate calls by outcome",
            ["status"],
            registry=self.registry,
        )
        self.prefill_retries = Counter(
            "pdxfer_router_prefill_retries",
            "Prefill calls retried on another instance",
            registry=self.registry,
        )
        self.decode_retries = Counter(
            "pdxfer_router_decode_retries",
            "Requests run again after a decode failed before its first token",
            registry=self.registry,
        )


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "pdxfer_router_ttft_seconds",
            "Time from an HTTP request to its first token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "pdxfer_router_itl_seconds",
            "Time between consecutive tokens of a request",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "pdxfer_router_e2e_seconds",
            "Time from an HTTP request to its last token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.client_gone = Counter(
            "pdxfer_router_http_client_gone",
            "HTTP requests cancelled because their client disconnected before the answer",
            registry=registry,
        )
