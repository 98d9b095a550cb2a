"""Closed-loop load against a router: `concurrency` clients, each sending its next request as
soon as its last one finished, until every prompt was served.

A work item is a conversation: its first prompt, then what the user adds at each later
turn. Turn t+1's prompt is turn t's prompt, the tokens generated for it and the addition,
so a multi-turn workload resends ever longer shared prefixes (one-turn items are plain
independent requests)."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from transfer.control.client import EXIT_CLOSE_WAIT_S, RouterClient
from transfer.control.errors import ControlError, GrpcCode
from transfer.control.types import GenerateRequest
from transfer.stats import percentile

# A full instance answers RESOURCE_EXHAUSTED; a closed-loop client backs off and resends,
# as an OpenAI client does on 429.
BACKOFF_S = 0.02


@dataclass
class _Request:
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    transfer_ms: float = 0.0
    exposed_transfer_ms: float = 0.0
    error: str = ""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    reused_decode_tokens: int = 0
    kv_bytes: int = 0
    state_bytes: int = 0
    generated: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.generated)


@dataclass(frozen=True)
class LoadResult:
    """One concurrency level. Latencies are {"p50": ms, "p99": ms}."""

    concurrency: int
    requests: int
    failed: int
    retries: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    ttft_ms: dict
    itl_ms: dict
    e2e_ms: dict
    transfer_ms: dict
    exposed_transfer_ms: dict = field(default_factory=dict)
    prompt_tokens: int = 0  # totals over the answered requests
    cached_prompt_tokens: int = 0  # not computed by prefill (its prefix cache)
    reused_decode_tokens: int = 0  # not read by decode (its prefix cache)
    kv_bytes: int = 0
    state_bytes: int = 0
    # sha256 of every request's tokens in (conversation, turn) order: two runs of one
    # workload generated the same tokens exactly when their digests are equal
    output_digest: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _p50_p99(values_s: Sequence[float], scale: float = 1e3) -> dict:
    if not values_s:
        return {"p50": 0.0, "p99": 0.0}
    ms = [v * scale for v in values_s]
    return {
        "p50": round(percentile(ms, 50, interpolate=True), 3),
        "p99": round(percentile(ms, 99, interpolate=True), 3),
    }


def run_load(
    address: str,
    token: str | None,
    conversations: Sequence[Sequence[Sequence[int]]],
    max_tokens: int,
    concurrency: int,
    timeout_s: float,
) -> LoadResult:
    """Serve every conversation (first prompt, then each later turn's addition) with
    `concurrency` clients in a closed loop, one turn after another; figures over all."""
    client = RouterClient(address, token=token, timeout_s=timeout_s)
    turns = [(c, t) for c, conv in enumerate(conversations) for t in range(len(conv))]
    results = {key: _Request() for key in turns}
    next_index = iter(range(len(conversations)))
    lock = threading.Lock()
    retries = [0]
    deadline = time.monotonic() + timeout_s
    run = secrets.token_hex(4)  # ids unique across loads: traces join by request id

    def one(key: tuple[int, int], prompt: Sequence[int], tag: str) -> list[int]:
        out = results[key]
        request = GenerateRequest(f"load-{run}-{tag}-{key[0]}-{key[1]}", tuple(prompt), max_tokens)
        out.prompt_tokens = len(prompt)
        while True:
            start = last = time.perf_counter()
            out.gaps_s.clear()
            out.generated = []
            try:
                for event in client.generate(request):
                    now = time.perf_counter()
                    if not out.generated:
                        out.ttft_s, out.transfer_ms = now - start, event.transfer_ms
                        out.exposed_transfer_ms = event.exposed_transfer_ms
                        out.kv_bytes, out.state_bytes = event.kv_bytes, event.state_bytes
                        out.cached_prompt_tokens = event.cached_prompt_tokens
                        out.reused_decode_tokens = event.reused_decode_tokens
                    else:
                        out.gaps_s.append(now - last)
                    last = now
                    out.generated.append(event.token)
                out.e2e_s = time.perf_counter() - start
                return out.generated
            except ControlError as exc:
                if exc.code != GrpcCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    out.error = str(exc)
                    return []
                with lock:
                    retries[0] += 1
                time.sleep(BACKOFF_S)

    def client_loop(tag: str) -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None or time.monotonic() > deadline:
                return
            prompt: list[int] = []
            for turn, addition in enumerate(conversations[index]):
                if turn and (results[index, turn - 1].error or time.monotonic() > deadline):
                    return  # the rest of the conversation counts as failed
                prompt = prompt + list(addition)
                prompt += one((index, turn), prompt, tag)

    threads = [
        threading.Thread(target=client_loop, args=(f"c{concurrency}-{i}",), daemon=True)
        for i in range(concurrency)
    ]
    began = time.perf_counter()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()) + 5.0)
    finally:
        client.close(EXIT_CLOSE_WAIT_S)
    wall = time.perf_counter() - began
    good = [r for r in results.values() if not r.error and r.tokens]
    tokens = sum(r.tokens for r in good)
    return LoadResult(
        concurrency=concurrency,
        requests=len(turns),
        failed=len(turns) - len(good),
        retries=retries[0],
        output_tokens=tokens,
        wall_s=round(wall, 3),
        output_tokens_per_s=round(tokens / wall, 3) if wall > 0 else 0.0,
        ttft_ms=_p50_p99([r.ttft_s for r in good]),
        itl_ms=_p50_p99([g for r in good for g in r.gaps_s]),
        e2e_ms=_p50_p99([r.e2e_s for r in good]),
        transfer_ms=_p50_p99([r.transfer_ms for r in good], scale=1.0),
        exposed_transfer_ms=_p50_p99([r.exposed_transfer_ms for r in good], scale=1.0),
        output_digest=_digest(results),
        **{
            name: sum(getattr(r, name) for r in good)
            for name in (
                "prompt_tokens",
                "cached_prompt_tokens",
                "reused_decode_tokens",
                "kv_bytes",
                "state_bytes",
            )
        },  # fmt: skip
    )


def _digest(results: dict[tuple[int, int], _Request]) -> str:
    digest = hashlib.sha256()
    for key in sorted(results):
        digest.update(repr((key, results[key].generated)).encode())
    return digest.hexdigest()
