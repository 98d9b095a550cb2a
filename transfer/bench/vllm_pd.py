"""`pdxfer bench vllm`'s runs: the same requests through vLLM P/D with each KV connector.

For each connector a prefill and a decode server start, one warm-up request runs (the first
after start-up is far slower, most of all at TP 2), then every request goes one at a time:
first the decode server alone (a colocated run at decode's TP, with a cache salt so it shares
no prefix blocks), then the two-step P/D protocol (`VllmEngine`, what pdxfer's router runs). The
connector's own `vllm:<connector>_*` histograms on both servers, read before and after, give
bytes, descriptors and transfer time; TTFT is the two-step's time to the first token.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from transfer.bench.vllm_metrics import ConnectorTotals, fetch_connector_totals
from transfer.serving.launch.vllm_servers import Connector, VllmServer
from transfer.serving.launch.vllm_stack import VllmPdPlan, running_vllm_pd
from transfer.serving.openai.schema import Sampling
from transfer.serving.openai.vllm_backend import VllmEngine, post_completion

Progress = Callable[[str], None]


@dataclass(frozen=True)
class BenchRequests:
    """`count` prompts of `prompt_tokens` seeded ids each, `max_tokens` greedy tokens."""

    count: int
    prompt_tokens: int
    max_tokens: int
    seed: int = 0
    vocab: int = 256  # ids below every tiny and real vocabulary

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [[rng.randrange(3, self.vocab) for _ in range(self.prompt_tokens)]
                for _ in range(self.count)]  # fmt: skip


@dataclass(frozen=True)
class ConnectorRun:
    """One connector's results at one TP pair; `error` says why there are none."""

    connector: Connector
    prefill_tp: int
    decode_tp: int
    totals: ConnectorTotals | None = None
    ttfts: tuple[float, ...] = ()
    tokens: tuple[tuple[int, ...], ...] = ()
    colocated: tuple[tuple[int, ...], ...] = ()
    error: str | None = None

    @property
    def equal_to_colocated(self) -> bool:
        return bool(self.tokens) and self.tokens == self.colocated


def _totals(servers: tuple[VllmServer, ...], connector: Connector) -> ConnectorTotals:
    # The metric prefix is the connector's name (vllm:nixl_*, vllm:pdxfer_*); a connector
    # may record on either side, so both servers count.
    parts = [fetch_connector_totals(s.url, connector.value) for s in servers]
    return ConnectorTotals(
        sum(p.transfers for p in parts), sum(p.bytes for p in parts),
        sum(p.descriptors for p in parts), sum(p.xfer_seconds for p in parts),
    )  # fmt: skip


def _two_step(engine: VllmEngine, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    sampling = Sampling(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    ttft, tokens = 0.0, []
    for event in engine.generate(f"bench-{random.getrandbits(48):x}", prompt, sampling):
        if not tokens:
            ttft = time.perf_counter() - start
        tokens.append(event.token)
    return ttft, tokens


def run_connector(
    plan: VllmPdPlan,
    requests: BenchRequests,
    log_dir: Path,
    timeout_s: float,
    progress: Progress,
) -> ConnectorRun:
    """Start `plan`'s servers, run `requests`, stop them; a failure becomes `error`."""
    label = f"{plan.connector.value} {plan.prefill_tp}->{plan.decode_tp}"
    prompts = requests.prompts()
    try:
        progress(f"[{label}] starting vLLM prefill and decode (logs in {log_dir})")
        with running_vllm_pd(plan, log_dir, timeout_s) as (prefill, decode):
            engine = VllmEngine([prefill.url], [decode.url], CollectorRegistry())
            progress(f"[{label}] warm-up request")
            _two_step(engine, prompts[0], requests.max_tokens)
            before = _totals((prefill, decode), plan.connector)
            ttfts, tokens, colocated = [], [], []
            for i, prompt in enumerate(prompts):
                alone = post_completion(decode.url, prompt, requests.max_tokens,
                                        cache_salt=f"colocated-{i}", timeout_s=timeout_s)  # fmt: skip
                colocated.append(tuple(alone["choices"][0]["token_ids"]))
                ttft, ids = _two_step(engine, prompt, requests.max_tokens)
                ttfts.append(ttft)
                tokens.append(tuple(ids))
                same = "equal" if tokens[-1] == colocated[-1] else "DIFFERENT"
                progress(f"[{label}] request {i + 1}/{len(prompts)}: TTFT {ttft * 1e3:.0f} ms, "
                         f"tokens {same} to colocated")  # fmt: skip
            totals = _totals((prefill, decode), plan.connector) - before
    except Exception as exc:  # noqa: BLE001 (reported per connector; the other still runs)
        progress(f"[{label}] failed: {exc}")
        return ConnectorRun(plan.connector, plan.prefill_tp, plan.decode_tp,
                            error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)  # fmt: skip
    return ConnectorRun(
        plan.connector, plan.prefill_tp, plan.decode_tp, totals,
        tuple(ttfts), tuple(tokens), tuple(colocated),
    )  # fmt: skip
