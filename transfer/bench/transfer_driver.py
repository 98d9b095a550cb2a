"""Drive `pdxfer bench transfer`: start the rank processes of each TP pair, verify and time
ours, raw and naive for each token count, and collect the figures.

One request's time = the slowest prefill rank's gather into staging (when the plan stages)
plus the slowest decode rank's post -> poll to DONE -> scatter. All decode ranks start
together; the modes take turns within each repeat, so a load change on the box hits all
three alike.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from transfer.bench.transfer_procs import RankHandle, RankProcess, call_all, stop_all
from transfer.bench.transfer_remote import RemotePeer
from transfer.bench.transfer_setup import (
    Instances,
    Transfers,
    build_instances,
    make_request,
    plan_all,
    staging_need,
)
from transfer.geometry import ModelGeometry

MODES = ("ours", "raw", "naive")
SETUP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Settings:
    transport: str
    nodes: str  # "loopback" | "netns" | "two-node"
    tokens: tuple[int, ...]
    repeats: int
    block_size: int
    tls: str | None  # None: UCX's own choice (netns forces "tcp")
    deadline_s: float
    seed: int
    hole_blocks: int = 8


Log = Callable[[str], None]


@contextlib.contextmanager
def placement(nodes: str, peer: RemotePeer | None = None) -> Iterator[tuple]:
    """(prefill node, decode node): None, None on loopback; two namespaces for netns;
    `peer`, None for two-node (told `done` at the end, so that it exits)."""
    if nodes == "loopback":
        yield None, None
        return
    if nodes == "two-node":
        try:
            yield peer, None
        finally:
            peer.finish()
        return
    from transfer.bench.netns import TwoNodes

    with TwoNodes() as pair:
        yield pair


def _start(label: str, node) -> RankHandle:
    if isinstance(node, RemotePeer):
        return node.connect(label)
    return RankProcess(label, node.wrap if node else None)


def _options(settings: Settings, node) -> dict:
    if node is None or isinstance(node, RemotePeer):
        return {"tls": settings.tls} if settings.tls else {}
    # Force the veth: on one box UCX would otherwise pick shared memory across namespaces.
    return {"tls": settings.tls or "tcp", "net_devices": node.device}


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


class PairRun:
    """The rank processes of one (prefill TP, decode TP) pair, and what they were told."""

    def __init__(self, instances: Instances, settings: Settings, nodes: tuple, log: Log) -> None:
        self.instances, self.settings, self.log, self.nodes = instances, settings, log, nodes
        self.prefill: list[RankHandle] = []
        self.decode: list[RankHandle] = []
        self.peers: list[list[str]] = []

    def start(self) -> None:
        p_node, d_node = self.nodes
        for r in range(len(self.instances.prefill)):
            self.prefill.append(_start(f"prefill rank {r}", p_node))
        for r in range(len(self.instances.decode)):
            self.decode.append(_start(f"decode rank {r}", d_node))
        p_options, d_options = _options(self.settings, p_node), _options(self.settings, d_node)
        tag = f"{len(self.prefill)}x{len(self.decode)}"
        setups = [
            dict(
                role="prefill",
                name=f"bench-p{r}-{tag}",
                arena_bytes=self.instances.arena_bytes("prefill"),
                backend=self.settings.transport,
                options=p_options,
                seed=self.settings.seed + r,
            )
            for r in range(len(self.prefill))
        ] + [
            dict(
                role="decode",
                name=f"bench-d{r}-{tag}",
                arena_bytes=self.instances.arena_bytes("decode"),
                backend=self.settings.transport,
                options=d_options,
                seed=0,
            )
            for r in range(len(self.decode))
        ]
        metadata = call_all(self.prefill + self.decode, "setup", SETUP_TIMEOUT_S, setups)
        p_meta = metadata[: len(self.prefill)]
        self.peers = call_all(
            self.decode, "add_peers", 120.0, [dict(metadata=p_meta)] * len(self.decode)
        )

    def stop(self) -> None:
        # Decode first: a read still in flight finishes before its source goes away.
        stop_all(self.decode)
        stop_all(self.prefill)

    # -- one request ----------------------------------------------------------------------

    def _prepare(self, transfers: Transfers) -> dict[str, list[int]]:
        """Send every rank its jobs; returns which prefill ranks gather for `ours`."""
        from transfer.dataplane import RangeBatch

        gathers: dict[int, list] = {}
        for d, plan in enumerate(transfers.ours):
            items = []
            for source in plan.sources:
                wire = source.wire
                batch = RangeBatch(wire.dst, wire.src, wire.lengths)
                items.append(
                    (
                        self.peers[d][source.prefill_rank],
                        batch,
                        source if len(source.scatter) else None,
                    )
                )
                if len(source.gather):
                    gathers.setdefault(source.prefill_rank, []).append(source)
            self.decode[d].call("prepare", job="ours", kind="read", items=items)
            for mode in ("raw", "naive"):
                items = [
                    (self.peers[d][p], RangeBatch(dst, src, lengths), None)
                    for p, src, dst, lengths in getattr(transfers, mode)[d]
                ]
                self.decode[d].call("prepare", job=mode, kind="read", items=items)
        for p, sources in gathers.items():
            self.prefill[p].call("prepare", job="ours", kind="gather", items=sources)
        return {"ours": sorted(gathers), "raw": [], "naive": []}

    def _run(self, mode: str, gathering: list[int]) -> float:
        timeout = self.settings.deadline_s + 60.0
        gather = 0.0
        if gathering:
            ranks = [self.prefill[p] for p in gathering]
            gather = max(
                call_all(
                    ranks,
                    "run",
                    timeout,
                    [dict(job=mode, deadline_s=self.settings.deadline_s)] * len(ranks),
                )
            )
        kwargs = [dict(job=mode, deadline_s=self.settings.deadline_s)] * len(self.decode)
        return gather + max(call_all(self.decode, "run", timeout, kwargs))

    def _verify(self, mode: str, transfers: Transfers) -> None:
        """Compare a CRC of the bytes each decode rank received, range by range, with the
        same ranges' bytes on the prefill side (ours: its unstaged mapping)."""
        if mode == "ours":
            pairs = [
                [(s.prefill_rank, s.wire.src, s.wire.dst, s.wire.lengths) for s in plan.sources]
                for plan in transfers.ours_direct
            ]
        else:
            pairs = list(getattr(transfers, mode))
        d_groups = [[(dst, lengths) for _, _, dst, lengths in ranges] for ranges in pairs]
        p_groups: list[list] = [[] for _ in self.prefill]
        where: list[list[tuple[int, int]]] = []
        for ranges in pairs:
            where.append([])
            for p, src, _, lengths in ranges:
                where[-1].append((p, len(p_groups[p])))
                p_groups[p].append((src, lengths))
        sums = call_all(
            self.decode + self.prefill,
            "checksum",
            300.0,
            [dict(groups=g) for g in d_groups + p_groups],
        )
        d_sums, p_sums = sums[: len(self.decode)], sums[len(self.decode) :]
        for d, sums in enumerate(d_sums):
            for got, (p, i) in zip(sums, where[d], strict=True):
                if got != p_sums[p][i]:
                    raise RuntimeError(
                        f"{mode}: decode rank {d} received wrong bytes from prefill rank {p} "
                        "(checksum mismatch): the benchmark would be timing a broken transfer"
                    )

    def measure(self, transfers: Transfers, label: str) -> dict[str, list[float]]:
        gathering = self._prepare(transfers)
        for mode in MODES:
            call_all(self.decode, "zero", 120.0)
            self._run(mode, gathering[mode])
            self._verify(mode, transfers)
        self.log(f"{label}: ours, raw and naive moved the right bytes")
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for repeat in range(self.settings.repeats):
            for mode in MODES:
                times[mode].append(self._run(mode, gathering[mode]))
            self.log(f"{label}: repeat {repeat + 1}/{self.settings.repeats}")
        for mode in MODES:
            call_all(self.decode, "drop", 60.0, [dict(job=mode)] * len(self.decode))
        call_all(self.prefill, "drop", 60.0, [dict(job="ours")] * len(self.prefill))
        return times


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
    entry["staged_sources"] = sum(
        s.mode.value != "direct" for plan in transfers.ours for s in plan.sources
    )
    entry["verified"] = True
    return entry


def run_pair(
    geometry: ModelGeometry, p_tp: int, d_tp: int, settings: Settings, nodes: tuple, log: Log
) -> tuple[list[dict], int]:
    """Results of every token count for one TP pair, and the pair's total arena bytes."""
    base = build_instances(geometry, p_tp, d_tp, settings.block_size, max(settings.tokens))
    requests = [
        make_request(base, n, settings.seed + n, settings.hole_blocks) for n in settings.tokens
    ]
    instances = build_instances(
        geometry,
        p_tp,
        d_tp,
        settings.block_size,
        max(settings.tokens),
        staging_need(base, requests),
    )
    log(
        f"P={p_tp} D={d_tp}: starting {p_tp + d_tp} rank processes "
        f"({instances.total_bytes / 2**30:.2f} GiB of arenas, {settings.transport}, {settings.nodes})"
    )
    run = PairRun(instances, settings, nodes, log)
    results = []
    try:
        run.start()
        for n, request in zip(settings.tokens, requests, strict=True):
            transfers = plan_all(instances, request)
            times = run.measure(transfers, f"P={p_tp} D={d_tp} {n} tokens")
            results.append(summarize(n, transfers, times, p_tp, d_tp))
    finally:
        run.stop()
    return results, instances.total_bytes
