"""Drive `pdxfer bench transfer`: start the rank processes of each TP pair, verify and time
ours, raw and naive for each token count, and collect the figures.

Modes: ours (the packer's plan, blocks from the contiguous pool), lowest (the same, blocks
from the old lowest-free-first pool after the same history), raw, naive. One request's
time = the slowest prefill rank's gather into staging (when the plan stages) plus the
slowest decode rank's post -> poll to DONE -> scatter. All decode ranks start together;
the modes take turns within each repeat, so a load change on the box hits all alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from transfer.agent.staging import StagingArea
from transfer.bench.prefill_model import stream_groups
from transfer.bench.transfer_rank import (
    BUILD,
    BenchAddPeers,
    BenchInfo,
    BenchRankSpec,
    Checksum,
    Drop,
    Prepare,
    ReadItem,
    Run,
    Zero,
)
from transfer.bench.transfer_remote import RemotePeer
from transfer.bench.transfer_results import MODES, STREAM_MODES, summarize
from transfer.bench.transfer_setup import (
    PLANNED_MODES,
    Instances,
    Transfers,
    build_instances,
    make_request,
    plan_all,
    staging_need,
)
from transfer.cache.extents import count_runs
from transfer.geometry import ModelGeometry
from transfer.serving.ranks.ranks import STOP_TIMEOUT_S, RankGroup, RankLink
from transfer.serving.role import ServeRole

SETUP_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 300.0


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
    layer_group: int = 0  # layers per streaming group; 0: no layer-wise modes
    prefill_tokens_per_s: float = 50_000.0  # the modelled prefill (layer-wise modes)
    stream_chunk_tokens: int = 8192  # its chunks (0: the whole prompt at once)
    model: ModelGeometry | None = None  # unscaled: the modelled prefill is the whole model's


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


def _options(settings: Settings, node) -> tuple[tuple[str, str], ...]:
    if node is None or isinstance(node, RemotePeer):
        return (("tls", settings.tls),) if settings.tls else ()
    # Force the veth: on one box UCX would otherwise pick shared memory across namespaces.
    return (("tls", settings.tls or "tcp"), ("net_devices", node.device))


class Side:
    """The ranks of one side, wherever they run: here, in a namespace, or on node 0."""

    def __init__(self, specs: list[BenchRankSpec], node, label: str) -> None:
        self.size = len(specs)
        self.group: RankGroup | None = None
        if isinstance(node, RemotePeer):
            self.link: RankLink = node.connect(specs, label)
            return
        wrap = node.wrap if node is not None else None
        self.group = RankGroup(
            specs, BUILD, wrap=wrap, label=label, start_timeout_s=SETUP_TIMEOUT_S
        )
        self.link = self.group.link

    def call(self, command, timeout_s: float = CALL_TIMEOUT_S) -> list:
        return self.link.call(command, timeout_s)

    def stop(self) -> None:
        if self.group is not None:
            self.group.close()
        else:
            self.link.stop(wait_s=STOP_TIMEOUT_S)


class PairRun:
    """The rank processes of one (prefill TP, decode TP) pair, and what they were told."""

    def __init__(self, instances: Instances, settings: Settings, nodes: tuple, log: Log) -> None:
        self.instances, self.settings, self.log, self.nodes = instances, settings, log, nodes
        self.sides: list[Side] = []

    @property
    def prefill(self) -> Side:
        return self.sides[0]

    @property
    def decode(self) -> Side:
        return self.sides[1]

    def _specs(self, role: ServeRole, tp: int, node) -> list[BenchRankSpec]:
        tag = f"{len(self.instances.prefill)}x{len(self.instances.decode)}"
        layouts = self.instances.prefill if role is ServeRole.PREFILL else self.instances.decode
        return [
            BenchRankSpec(
                role=role,
                name=f"bench-{role[0]}{r}-{tag}",
                rank=r,
                tp=tp,
                arena_bytes=self.instances.arena_bytes(role),
                backend=self.settings.transport,
                options=_options(self.settings, node),
                seed=self.settings.seed + r if role is ServeRole.PREFILL else 0,
                staging=StagingArea.of(layouts[r]),
            )
            for r in range(tp)
        ]

    def start(self) -> None:
        p_node, d_node = self.nodes
        p_tp, d_tp = len(self.instances.prefill), len(self.instances.decode)
        self.sides.append(
            Side(self._specs(ServeRole.PREFILL, p_tp, p_node), p_node, "prefill ranks")
        )
        self.sides.append(Side(self._specs(ServeRole.DECODE, d_tp, d_node), d_node, "decode ranks"))
        metadata = tuple(self.prefill.call(BenchInfo(), SETUP_TIMEOUT_S))
        self.decode.call(BenchAddPeers(metadata), SETUP_TIMEOUT_S)

    def stop(self) -> None:
        # Decode first: a read still in flight finishes before its source goes away.
        for side in reversed(self.sides):
            side.stop()

    # -- one request ----------------------------------------------------------------------

    def _prepare(self, transfers: Transfers) -> dict[str, bool]:
        """Send every rank its jobs; returns whether any prefill rank gathers, per mode."""
        from transfer.dataplane import RangeBatch

        gathering = dict.fromkeys(("raw", "naive", *STREAM_MODES), False)
        for mode in PLANNED_MODES:
            gathers: list[list] = [[] for _ in range(self.prefill.size)]
            reads = []
            for plan in getattr(transfers, mode):
                items = []
                for source in plan.sources:
                    wire = source.wire
                    batch = RangeBatch(wire.dst, wire.src, wire.lengths)
                    staged = source if len(source.scatter) else None
                    items.append(ReadItem(source.prefill_rank, batch, staged))
                    if len(source.gather):
                        gathers[source.prefill_rank].append(source)
                reads.append(tuple(items))
            if reads:
                self.decode.call(Prepare(mode, "read", tuple(reads)))
                self.prefill.call(Prepare(mode, "gather", tuple(tuple(g) for g in gathers)))
            gathering[mode] = any(gathers)
        if transfers.stream:
            self._prepare_stream(transfers)
        for mode in ("raw", "naive"):
            items = tuple(
                tuple(
                    ReadItem(p, RangeBatch(dst, src, lengths)) for p, src, dst, lengths in per_rank
                )
                for per_rank in getattr(transfers, mode)
            )
            self.decode.call(Prepare(mode, "read", items))
        return gathering

    def _prepare_stream(self, transfers: Transfers) -> None:
        from transfer.dataplane import RangeBatch

        def items(group, decode_rank: int) -> tuple[ReadItem, ...]:
            wire = [s.wire for s in group[decode_rank].sources if len(s.wire)]
            ranks = [s.prefill_rank for s in group[decode_rank].sources if len(s.wire)]
            return tuple(
                ReadItem(p, RangeBatch(w.dst, w.src, w.lengths))
                for p, w in zip(ranks, wire, strict=True)
            )

        for mode in STREAM_MODES:
            jobs = tuple(
                tuple(
                    (ready if mode == "stream" else 0.0, items(group, d))
                    for group, ready in zip(transfers.stream, transfers.stream_ready_s, strict=True)
                )
                for d in range(self.decode.size)
            )
            self.decode.call(Prepare(mode, "stream", jobs))

    def _run(self, mode: str, gathering: bool) -> float:
        timeout = self.settings.deadline_s + 60.0
        command = Run(mode, self.settings.deadline_s)
        gather = max(self.prefill.call(command, timeout)) if gathering else 0.0
        return gather + max(self.decode.call(command, timeout))

    def _verify(self, mode: str, transfers: Transfers) -> None:
        """Compare a CRC of the bytes each decode rank received, range by range, with the
        same ranges' bytes on the prefill side (ours, lowest: the unstaged mapping)."""
        if mode in PLANNED_MODES:
            pairs = [
                [(s.prefill_rank, s.wire.src, s.wire.dst, s.wire.lengths) for s in plan.sources]
                for plan in getattr(transfers, f"{mode}_direct")
            ]
        elif mode in STREAM_MODES:
            pairs = [
                [
                    (s.prefill_rank, s.wire.src, s.wire.dst, s.wire.lengths)
                    for group in transfers.stream
                    for s in group[d].sources
                ]
                for d in range(self.decode.size)
            ]
        else:
            pairs = list(getattr(transfers, mode))
        d_groups = tuple(tuple((dst, lengths) for _, _, dst, lengths in r) for r in pairs)
        p_groups: list[list] = [[] for _ in range(self.prefill.size)]
        where: list[list[tuple[int, int]]] = []
        for ranges in pairs:
            where.append([])
            for p, src, _, lengths in ranges:
                where[-1].append((p, len(p_groups[p])))
                p_groups[p].append((src, lengths))
        d_sums = self.decode.call(Checksum(d_groups))
        p_sums = self.prefill.call(Checksum(tuple(tuple(g) for g in p_groups)))
        for d, sums in enumerate(d_sums):
            for got, (p, i) in zip(sums, where[d], strict=True):
                if got != p_sums[p][i]:
                    raise RuntimeError(
                        f"{mode}: decode rank {d} received wrong bytes from prefill rank {p} "
                        "(checksum mismatch): the benchmark would be timing a broken transfer"
                    )

    def measure(self, transfers: Transfers, label: str) -> dict[str, list[float]]:
        gathering = self._prepare(transfers)
        modes = [
            m
            for m in MODES
            if (m not in PLANNED_MODES or getattr(transfers, m))
            and (m not in STREAM_MODES or transfers.stream)
        ]
        for mode in modes:
            self.decode.call(Zero())
            self._run(mode, gathering[mode])
            self._verify(mode, transfers)
        self.log(f"{label}: {', '.join(modes)} moved the right bytes")
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for repeat in range(self.settings.repeats):
            for mode in modes:
                times[mode].append(self._run(mode, gathering[mode]))
            self.log(f"{label}: repeat {repeat + 1}/{self.settings.repeats}")
        for mode in modes:
            self.decode.call(Drop(mode))  # every mode was prepared on the decode side
        for mode in PLANNED_MODES:
            self.prefill.call(Drop(mode))
        return times


def run_pair(
    geometry: ModelGeometry, p_tp: int, d_tp: int, settings: Settings, nodes: tuple, log: Log
) -> tuple[list[dict], int]:
    """Results of every token count for one TP pair, and the pair's total arena bytes."""
    base = build_instances(geometry, p_tp, d_tp, settings.block_size, max(settings.tokens))
    # One history per token count (its seed), replayed on both block policies.
    requests, lowest = (
        [
            make_request(base, n, settings.seed + n, settings.hole_blocks, policy)
            for n in settings.tokens
        ]
        for policy in ("contiguous", "lowest")
    )
    instances = build_instances(
        geometry,
        p_tp,
        d_tp,
        settings.block_size,
        max(settings.tokens),
        staging_need(base, requests + lowest),
        settings.layer_group,
    )
    log(
        f"P={p_tp} D={d_tp}: starting {p_tp + d_tp} rank processes "
        f"({instances.total_bytes / 2**30:.2f} GiB of arenas, {settings.transport}, {settings.nodes})"
    )
    run = PairRun(instances, settings, nodes, log)
    results = []
    try:
        run.start()
        for n, request, old in zip(settings.tokens, requests, lowest, strict=True):
            stream = (
                stream_groups(
                    geometry,
                    n,
                    settings.prefill_tokens_per_s,
                    settings.layer_group,
                    settings.stream_chunk_tokens,
                    whole_model=settings.model,
                )
                if settings.layer_group
                else ()
            )
            transfers = plan_all(instances, request, old, stream)
            times = run.measure(transfers, f"P={p_tp} D={d_tp} {n} tokens")
            entry = summarize(n, transfers, times, p_tp, d_tp)
            for prefix, req in (("", request), ("lowest_", old)):
                entry[f"{prefix}prefill_block_runs"] = count_runs(req.src_blocks)
                entry[f"{prefix}decode_block_runs"] = count_runs(req.dst_blocks)
            results.append(entry)
    finally:
        run.stop()
    return results, instances.total_bytes
