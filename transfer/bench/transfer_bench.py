"""`pdxfer bench transfer`: one request's cache moved from prefill to decode rank processes.

Prefill and decode ranks are separate processes, each with one arena laid out from the
real model geometry (layers scaled down when the arenas would not fit), blocks and slots
allocated from fragmented pools. Per token count it times ours (the packer's plan, blocks
from the contiguous pool), lowest (the same request placed by the old lowest-free-first
pool after the same history), raw
(the same bytes per rank pair as one contiguous range: the ceiling) and naive (one
descriptor per layer, block and K/V region, as vLLM's NixlConnector posts), after checking
that each moved the right bytes. The report (key `results`) is a public interface.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from transfer.bench.transfer_remote import RemotePeer
from transfer.errors import InvalidInput
from transfer.geometry import ModelGeometry


@dataclass(frozen=True)
class TransferBenchConfig:
    """One `bench transfer` run. `peer` is node 0 in two-node mode (then this process is
    node 1, the driver), else None."""

    geometry: ModelGeometry
    pairs: tuple[tuple[int, int], ...]  # (prefill TP, decode TP)
    tokens: tuple[int, ...]
    transport: str = "nixl"
    nodes: str = "loopback"  # "loopback" | "netns"
    peer: RemotePeer | None = None
    repeats: int = 5
    block_size: int = 16
    max_arena_bytes: int = 6 << 30
    tls: str | None = None
    deadline_s: float = 120.0
    control_tickets: int = 1000
    control_concurrency: int = 16
    hole_blocks: int = 8
    seed: int = 0
    stream_layers: int = 0  # layer-wise streaming groups; 0: no layer-wise modes
    prefill_tokens_per_s: float = 50_000.0
    stream_chunk_tokens: int = 8192

    def __post_init__(self) -> None:
        for name, low in (
            ("repeats", 1),
            ("block_size", 1),
            ("hole_blocks", 1),
            ("control_tickets", 0),
            ("control_concurrency", 1),
            ("stream_layers", 0),
            ("stream_chunk_tokens", 0),
        ):
            if getattr(self, name) < low:
                raise InvalidInput(f"{name}: must be >= {low}, got {getattr(self, name)}")
        if not self.prefill_tokens_per_s > 0:
            raise InvalidInput(
                f"prefill_tokens_per_s: must be positive, got {self.prefill_tokens_per_s}"
            )
        if not self.deadline_s > 0:
            raise InvalidInput(f"deadline_s: must be positive, got {self.deadline_s}")
        if not self.tokens or min(self.tokens) < 1:
            raise InvalidInput(f"tokens: lengths must be >= 1, got {self.tokens}")
        if self.peer is not None and self.nodes == "netns":
            raise InvalidInput("nodes: netns cannot be combined with a two-node peer")
        for p, d in self.pairs:
            for name, tp in (("prefill_tp", p), ("decode_tp", d)):
                if tp < 1:
                    raise InvalidInput(f"{name}: must be >= 1, got {tp}")
                try:
                    self.geometry.check_tp(tp)
                except ValueError as exc:
                    raise InvalidInput(f"{name} {tp}: {self.geometry.name}: {exc}") from None

    @property
    def placement(self) -> str:
        return "two-node" if self.peer is not None else self.nodes


def serve_ranks(port: int, token: bytes | None) -> int:
    """Node 0 of two-node mode: host the prefill ranks until the driver is done."""
    from transfer.bench.transfer_host import RankHost

    host = RankHost(port, token, _log)
    with_sigterm_as_interrupt(host.serve)
    return 0


def _log(message: str) -> None:
    print(f"[bench transfer {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _machine() -> dict:
    import platform

    import torch

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(memory / 2**30, 1),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
    }


def _control(tickets: int, concurrency: int) -> dict:
    from transfer.bench.control import measure

    result = measure(tickets, concurrency)
    serial, loaded = result["serial"], result["loaded"]
    return {
        "definition": result["definition"],
        "tickets": tickets,
        "concurrency": concurrency,
        "p50_ms": serial["p50_ms"],
        "p99_ms": serial["p99_ms"],
        "loaded_p50_ms": loaded["p50_ms"],
        "loaded_p99_ms": loaded["p99_ms"],
        "tickets_per_s": loaded["tickets_per_s"],
    }


def with_sigterm_as_interrupt(work):
    """SIGTERM unwinds like Ctrl-C, so rank processes and namespaces are always removed."""
    if threading.current_thread() is not threading.main_thread():
        return work()

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        return work()
    finally:
        signal.signal(signal.SIGTERM, previous)


def measure(config: TransferBenchConfig) -> dict:
    """Run every TP pair and token count; the report."""
    from transfer.bench.transfer_driver import Settings, placement, run_pair
    from transfer.bench.transfer_setup import fit_geometry

    geometry, tokens = config.geometry, config.tokens
    scaled = fit_geometry(
        geometry, config.pairs, config.block_size, max(tokens), config.max_arena_bytes
    )
    if len(scaled.layers) < len(geometry.layers):
        _log(
            f"scaled {geometry.name} from {len(geometry.layers)} to {len(scaled.layers)} layers "
            f"to fit max_arena_bytes {config.max_arena_bytes} at {max(tokens)} tokens"
        )
    nodes = config.placement
    settings = Settings(
        config.transport,
        nodes,
        tokens,
        config.repeats,
        config.block_size,
        config.tls,
        config.deadline_s,
        config.seed,
        config.hole_blocks,
        config.stream_layers,
        config.prefill_tokens_per_s,
        config.stream_chunk_tokens,
        geometry,
    )
    results, arenas = [], {}
    with placement(nodes, config.peer) as where:
        for p, d in config.pairs:
            pair_results, arena_bytes = run_pair(scaled, p, d, settings, where, _log)
            results += pair_results
            arenas[f"{p}:{d}"] = arena_bytes
    report = {
        "model": geometry.name,
        "layers": len(scaled.layers),
        "model_layers": len(geometry.layers),
        "transport": config.transport,
        "nodes": nodes,
        "tls": config.tls or ("tcp" if config.nodes == "netns" else "ucx default"),
        "block_size": config.block_size,
        "hole_blocks": config.hole_blocks,
        "repeats": config.repeats,
        "stream_layers": config.stream_layers,
        "prefill_tokens_per_s": config.prefill_tokens_per_s if config.stream_layers else None,
        "stream_chunk_tokens": config.stream_chunk_tokens if config.stream_layers else None,
        "arena_bytes": arenas,
        "definitions": {
            "time": "one request: slowest prefill gather (if staged) + slowest decode post..DONE..scatter",
            "gbps": "bytes / median time, 1 GB = 1e9 B",
            "ours": "the packer's plan; blocks from the contiguous pool (fewest free runs)",
            "lowest": "the packer's plan; blocks from the old lowest-free-first pool, same history",
            "raw": "the same bytes per (decode rank, prefill rank) pair as one contiguous range",
            "naive": "one descriptor per (layer, block, K/V region) and per (layer, state tensor, slot), vLLM-like layout",
            "efficiency": "gbps / raw_gbps (lowest_efficiency: lowest_gbps / raw_gbps)",
            "block_runs": "runs of consecutive block ids in the request's block table, per side",
            "speedup": "gbps / naive_gbps",
            "exposed_ms": "layer-wise: each chunk's KV of each group of --stream-layers layers "
            "(and the group's state, with the last chunk) posted when the modelled prefill "
            "finishes it; time from the end of the prefill to the last byte",
            "whole_exposed_ms": "ours' median: the whole request posted when prefill ends",
            "exposed_ratio": "exposed_ms / whole_exposed_ms (same run)",
            "groups": "the layer-wise plans posted all at once (groups_efficiency: vs raw)",
        },
        "results": results,
        "machine": _machine(),
    }
    if config.control_tickets:
        _log(f"control plane: {config.control_tickets} ticket round trips")
        report["control"] = _control(config.control_tickets, config.control_concurrency)
    return report
