"""`ConnectorWorker`: the PdxferConnector's half inside each vLLM worker (one per TP rank).

Start-up: vLLM's cache views become pdxfer geometry plus an `ExplicitLayout` over vLLM's
own memory (`layout_vllm`), registered with the transport once; the rank's
`RankHandshake` goes to the scheduler half. Every step: prefill ids the scheduler released
are echoed as finished sending (vLLM then frees their blocks); decode loads are planned with
pdxfer's packer against the prefill ranks' layouts (the scheduler half's handshake with each
prefill instance, sent along with the first load that reads it: a worker never calls the
control plane) and posted through the `TransferAgent`. A load
finishes -- and its failure is reported -- only once nothing of it can still land.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, UniformTypeKVCacheSpecs

from transfer.agent import Finished, PeerReads, TransferAgent, stage_small
from transfer.cache.explicit_layout import ExplicitLayout
from transfer.dataplane import RangeBatch, make_transport
from transfer.errors import InvalidInput
from transfer.presets import from_hf_config, from_hf_dict
from transfer.vllm.config import PdxferConfig
from transfer.vllm.digests import DIGEST_SLOTS, table_bytes
from transfer.vllm.fault import hold_loads
from transfer.vllm.layout_vllm import STATE_ORDER_DS, STATE_ORDER_SD, VllmMemory, describe
from transfer.vllm.load_plan import CacheGroup, plan_load
from transfer.vllm.metadata import (
    DigestSpec,
    LoadSpec,
    PrefillPeer,
    RankHandshake,
    StageSpec,
    StepMetadata,
)
from transfer.vllm.region_copies import Columns, RegionCopies
from transfer.vllm.stage_tail import STAGE_SLOTS, gather_copies, slot_bytes
from transfer.vllm.stats import PdxferStats
from transfer.vllm.worker_verify import RankVerifier, digest_slot_bytes

logger = logging.getLogger(__name__)

# The read-side staging buffer (registered with the transport next to vLLM's memory): room
# for the staged spans of the loads in flight; a load that finds none reads directly.
STAGING_BYTES = 8 << 20


@dataclass(frozen=True)
class _Tables:
    """A load's digest tables (verify): the prefill ranks' layouts, and per prefill rank
    where its table lands in staging, (offset, bytes)."""

    layouts: tuple[ExplicitLayout, ...]
    landed: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class _Peer:
    """A prefill instance as this rank reads it."""

    layouts: tuple[ExplicitLayout, ...]
    agents: tuple[str, ...]  # connected transport peer per prefill rank


def model_geometry(vllm_config: Any):
    """pdxfer geometry of the served model: its config.json, else vLLM's hf config."""
    model = Path(str(vllm_config.model_config.model))
    if (model / "config.json").is_file():
        return from_hf_config(model)
    hf = vllm_config.model_config.hf_config.to_dict()
    return from_hf_dict(hf, str(vllm_config.model_config.model))


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


def _conv_order() -> str:
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return STATE_ORDER_DS if is_conv_state_dim_first() else STATE_ORDER_SD


def _groups(kv_cache_config: Any) -> tuple[CacheGroup, ...]:
    groups = []
    for group in kv_cache_config.transfer_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        if not isinstance(spec, AttentionSpec | MambaSpec):
            raise InvalidInput(f"vLLM caches: group of {type(spec).__name__} is not supported")
        layers = frozenset(_layer_index(n) for n in group.layer_names)
        groups.append(CacheGroup(layers, isinstance(spec, AttentionSpec)))
    return tuple(groups)


def _layer_specs(kv_cache_config: Any) -> dict[str, Any]:
    specs = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            if isinstance(spec, UniformTypeKVCacheSpecs):
                specs[name] = spec.kv_cache_specs[name]
            else:
                specs[name] = spec
    return specs


class ConnectorWorker:
    """The worker half; `connector.PdxferConnector` forwards its worker hooks here."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: PdxferConfig) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.config = config
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        self.rank = get_tensor_model_parallel_rank()
        self.geometry = model_geometry(vllm_config)
        self.groups = _groups(kv_cache_config)
        self.memory: VllmMemory | None = None
        self.layouts: tuple[ExplicitLayout, ...] = ()
        self.agent: TransferAgent | None = None
        self._handshake: RankHandshake | None = None
        self._peers: dict[str, _Peer] = {}
        self._loads: dict[str, LoadSpec] = {}
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._stuck_logged: set[str] = set()  # loads failed but not settled, logged once
        self._error_blocks: set[int] = set()
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._staging_start = 0
        self._staging_held: dict[str, tuple[int, int]] = {}  # request -> (offset, bytes)
        self._landing: dict[str, Columns] = {}  # request -> staging -> cache copies, once landed
        self._copies: RegionCopies | None = None
        self._stage_out = torch.empty(0, dtype=torch.uint8)  # prefill's stage slots
        self._stage_start = 0
        self._stage_slot_bytes = 0
        # verify: prefill's digest slots; decode's tables of the loads in flight
        self._digest_out = torch.empty(0, dtype=torch.uint8)
        self._digest_start = 0
        self._digest_slot_bytes = 0
        self._verifier: RankVerifier | None = None
        self._verifying: dict[str, _Tables] = {}
        self._unverified_peers: set[str] = set()
        self.stats = PdxferStats()

    # ---- start-up -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        specs = _layer_specs(self.kv_cache_config)
        layers: dict[int, tuple[Any, torch.Tensor]] = {}
        for name, view in kv_caches.items():
            if name not in specs:
                continue
            layers[_layer_index(name)] = (specs[name], view)
        engine = f"vllm-{_vllm_version()}"
        self.memory, regions = describe(self.geometry, self.tp, layers, _conv_order(), engine)
        self.layouts = tuple(self.memory.layout(r) for r in range(self.tp))
        transport = make_transport(
            self.config.transport.value, f"pdxfer-vllm-{self.rank}-{uuid.uuid4().hex[:8]}"
        )
        self.agent = TransferAgent(transport)
        device = regions[0].device
        self._staging = torch.zeros(STAGING_BYTES, dtype=torch.uint8, device=device)
        self._stage_slot_bytes = slot_bytes(self.layouts[self.rank])
        self._stage_out = torch.zeros(
            max(1, STAGE_SLOTS * self._stage_slot_bytes), dtype=torch.uint8, device=device
        )
        if self.config.verify:
            self._digest_slot_bytes = digest_slot_bytes(self.layouts[self.rank])
        self._digest_out = torch.zeros(
            max(1, DIGEST_SLOTS * self._digest_slot_bytes), dtype=torch.uint8, device=device
        )
        ours = [self._staging, self._stage_out, self._digest_out]
        metadata = self.agent.register([*regions, *ours])
        region_map = self.agent.transport.region_map
        assert region_map is not None
        self._staging_start, self._stage_start, self._digest_start = (
            r.start for r in region_map.regions[len(regions) :]
        )
        self._copies = RegionCopies([*regions, *ours], region_map)
        self._verifier = RankVerifier(self.groups, self.layouts[self.rank], self._copies)
        self._handshake = RankHandshake(
            self.rank,
            self.tp,
            self.layouts[self.rank].to_dict(),
            metadata,
            self._stage_start,
            self._stage_slot_bytes,
            self._digest_start,
            self._digest_slot_bytes,
        )
        logger.info(
            "pdxfer: rank %d/%d registered %d region(s), %d B virtual; block size %d, "
            "%d blocks, conv %s",
            self.rank,
            self.tp,
            len(regions),
            self.memory.region_map.extent,
            self.memory.block_size,
            self.memory.num_blocks,
            _conv_order(),
        )

    def get_handshake_metadata(self) -> RankHandshake | None:
        return self._handshake

    # ---- every step ---------------------------------------------------------------------

    def start_load_kv(self, meta: StepMetadata) -> None:
        self._finished_sending.update(meta.released)
        if meta.loads and self.config.test_hold_loads_file:
            hold_loads(Path(self.config.test_hold_loads_file), [x.request_id for x in meta.loads])
        for address, peer in meta.peers.items():
            self._connect(address, peer)
        for load in meta.loads:
            try:
                reads, copies = self._plan(load)
                reads = [*reads, *self._digest_reads(load)]
            except Exception as exc:  # the load fails, vLLM recomputes; the server lives
                logger.warning(
                    "pdxfer: load of %s from %s failed before posting: %s",
                    load.request_id,
                    load.ticket.control_address,
                    exc,
                )
                self._staging_held.pop(load.request_id, None)
                self._staging_held.pop(_tables_key(load.request_id), None)
                self._verifying.pop(load.request_id, None)
                self._fail(load)
                continue
            self._loads[load.request_id] = load
            if copies is not None:
                self._landing[load.request_id] = copies
            assert self.agent is not None
            self.agent.post(load.request_id, reads)

    def save_stages(self, stages: list[StageSpec]) -> None:
        """Prefill, after the forward: gather each partial last block into its stage slot."""
        if not stages:
            return
        assert self._copies is not None
        for stage in stages:
            at = self._stage_start + stage.slot * self._stage_slot_bytes
            copies = gather_copies(self.layouts[self.rank], stage.block, stage.tokens, at)
            self._copies.copy(*copies)

    def save_digests(self, specs: list[DigestSpec]) -> None:
        """Prefill, after the forward (verify): each finished request's digest table into
        its slot. A table not written fails decode's check of the load."""
        assert self._verifier is not None or not specs
        size = self._digest_slot_bytes
        for spec in specs:
            slot = self._digest_out[spec.slot * size : (spec.slot + 1) * size]
            try:
                assert self._verifier is not None
                self._verifier.write_table(spec, slot)
            except Exception as exc:
                logger.warning("pdxfer verify: no digests for %s: %s", spec.request_id, exc)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.agent is not None:
            for done in self.agent.poll():
                self._finish(done)
                self._stuck_logged.discard(done.key)
            self._log_unsettled()
        sending, self._finished_sending = self._finished_sending, set()
        recving, self._finished_recving = self._finished_recving, set()
        failed, self._failed_recving = self._failed_recving, set()
        return KVConnectorTransferResults(sending, recving | failed, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._error_blocks = self._error_blocks, set()
        return errors

    def get_kv_connector_stats(self) -> PdxferStats | None:
        if self.stats.is_empty():
            return None
        return self.stats.clone_and_reset()

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None

    # ---- loads --------------------------------------------------------------------------

    def _log_unsettled(self) -> None:
        """Name, once, each load that failed (its deadline passed, say) while the transport
        cannot yet vouch that none of its bytes still land: vLLM keeps its blocks till then."""
        assert self.agent is not None
        for key in self._loads.keys() - self._stuck_logged:
            failure = self.agent.failure(key)
            if failure:
                self._stuck_logged.add(key)
                logger.warning(
                    "pdxfer: load of %s failed (%s); its blocks stay held until the transport "
                    "settles it",
                    key,
                    failure,
                )

    def _finish(self, done: Finished) -> None:
        """A load whose reads all settled: its staged pieces into place, its check (verify),
        then finished or failed."""
        load = self._loads.pop(done.key)
        landing = self._landing.pop(done.key, None)
        tables = self._verifying.pop(done.key, None)
        error, seconds = done.error, done.seconds
        if not error:
            started = time.perf_counter()
            try:
                if landing is not None:
                    assert self._copies is not None
                    self._copies.copy(*landing)
                seconds += time.perf_counter() - started
                problems = self._check(load, tables) if tables is not None else []
            except Exception as exc:
                error = f"after landing: {exc}"
            else:
                if problems:
                    self.stats.record_verify_failure()
                    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
                    error = "verify: " + "; ".join(problems[:3]) + more
        self._staging_held.pop(done.key, None)
        self._staging_held.pop(_tables_key(done.key), None)
        if error:
            logger.warning("pdxfer: load of %s failed: %s", done.key, error)
            self._fail(load)
            return
        self.stats.record_transfer(done.nbytes, done.descriptors, seconds)
        self._finished_recving.add(done.key)

    def _digest_reads(self, load: LoadSpec) -> list[PeerReads]:
        """Verify: every prefill rank's table of the request, read into staging with the
        load (InvalidInput when staging has no room: the load then fails)."""
        if not self.config.verify:
            return []
        address = load.ticket.control_address
        if not load.ticket.digest_offsets:
            if address not in self._unverified_peers:
                self._unverified_peers.add(address)
                logger.warning("pdxfer verify: %s publishes no digests (verify off there); "
                               "its loads go unchecked", address)  # fmt: skip
            return []
        peer = self._peer(address)
        sizes = [table_bytes(layout) for layout in peer.layouts]
        at = self._hold_staging(_tables_key(load.request_id), sum(sizes))
        if at is None:
            raise InvalidInput("verify: no staging room for the prefill ranks' digest tables")
        reads, landed = [], []
        for agent, remote, size in zip(peer.agents, load.ticket.digest_offsets, sizes, strict=True):
            local = np.asarray([self._staging_start + at], dtype=np.int64)
            ranges = RangeBatch(local, np.asarray([remote], dtype=np.int64), np.asarray([size]))
            reads.append(PeerReads(agent, ranges))
            landed.append((at, size))
            at += size
        self._verifying[load.request_id] = _Tables(peer.layouts, tuple(landed))
        return reads

    def _check(self, load: LoadSpec, tables: _Tables) -> list[str]:
        assert self._verifier is not None
        landed = [self._staging[at : at + n].cpu().numpy() for at, n in tables.landed]
        return self._verifier.check(load, tables.layouts, landed)

    def _fail(self, load: LoadSpec) -> None:
        self.stats.record_failed_transfer()
        self._failed_recving.add(load.request_id)
        # vLLM takes block-level load errors only with one KV cache group; with several (any
        # hybrid model) the engine dies on them, and the request id in failed_recving is the
        # whole report.
        if len(self.groups) == 1:
            for group in load.block_ids:
                self._error_blocks.update(group)

    def _connect(self, address: str, peer: PrefillPeer) -> None:
        """Learn a prefill instance from the scheduler's handshake with it (local calls only);
        if that fails, its loads fail (vLLM recomputes) and the server lives."""
        assert self.agent is not None
        self._peers.pop(address, None)
        started = time.monotonic()
        try:
            layouts = tuple(ExplicitLayout.from_dict(json.loads(raw)) for raw in peer.layouts)
            agents = tuple(self.agent.connect(m) for m in peer.agent_metadata)
        except Exception as exc:
            logger.warning("pdxfer: prefill %s (%s) unusable: %s", peer.instance_id, address, exc)
            return
        self._peers[address] = _Peer(layouts, agents)
        # Once per prefill instance: a connect that takes seconds shows here (TP-2 hangs).
        logger.info(
            "pdxfer: rank %d connected to prefill %s (%d agents) in %.3f s",
            self.rank,
            address,
            len(agents),
            time.monotonic() - started,
        )

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is None:
            raise InvalidInput(f"ticket.control_address: no usable handshake with {address}")
        return peer

    def _plan(self, load: LoadSpec) -> tuple[list[PeerReads], tuple | None]:
        """The load's reads, small neighbouring ranges staged when staging has room. A
        staged tail (the partial last block, `stage_tail`) lands in staging too; without
        room for all of it, that block crosses whole."""
        peer = self._peer(load.ticket.control_address)
        plan = partial(
            plan_load,
            self.groups,
            peer.layouts,
            self.layouts,
            self.rank,
            load.ticket.block_ids,
            load.block_ids,
            load.num_tokens,
        )
        reads = plan(load.ticket.staged_offsets)
        sources = list(reads.per_source.items())
        sizes = [stage_small(dst, src, n, 0).staging_bytes for _, (src, dst, n) in sources]
        tail_bytes = reads.tail.nbytes if reads.tail is not None else 0
        total = sum(sizes) + tail_bytes
        offset = self._hold_staging(load.request_id, total) if total else None
        if offset is None and reads.tail is not None:
            reads = plan(())
            sources = list(reads.per_source.items())
        if offset is None:
            direct = [
                PeerReads(peer.agents[p], RangeBatch(dst, src, n)) for p, (src, dst, n) in sources
            ]
            return direct, None
        posted, copies = [], []
        base = self._staging_start + offset
        if reads.tail is not None:
            assert self.agent is not None
            self.agent.zero_local(*reads.tail.clear)  # before anything of the load lands
            tail_sources, tail_copies = reads.tail.shifted(base)
            base += tail_bytes
            for p, (src, dst, n) in tail_sources.items():
                posted.append(PeerReads(peer.agents[p], RangeBatch(dst, src, n)))
            copies.append(tail_copies)
        for (p, (src, dst, n)), size in zip(sources, sizes, strict=True):
            staged = stage_small(dst, src, n, base)
            base += size
            posted.append(PeerReads(peer.agents[p], RangeBatch(*staged.wire)))
            copies.append(staged.copies)
        joined = tuple(np.concatenate(c) for c in zip(*copies, strict=True))
        return posted, joined

    def _hold_staging(self, key: str, nbytes: int) -> int | None:
        """First fit in the staging buffer (None: no room; the load then reads directly)."""
        cursor = 0
        for start, size in sorted(self._staging_held.values()):
            if start - cursor >= nbytes:
                break
            cursor = max(cursor, start + size)
        if cursor + nbytes > self._staging.numel():
            return None
        self._staging_held[key] = (cursor, nbytes)
        return cursor


def _tables_key(request_id: str) -> str:
    """The staging hold of a load's digest tables (apart from its staged reads)."""
    return f"{request_id}#digests"


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))
