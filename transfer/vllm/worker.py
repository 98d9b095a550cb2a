"""`ConnectorWorker`: the PdxferConnector's half inside each vLLM worker (one per TP rank).

Start-up: vLLM's cache views become pdxfer geometry plus an `ExplicitLayout` over vLLM's
own memory (`layout_vllm`), registered with the transport once, next to the staging buffer
and prefill's stage and digest slots; the rank's `RankHandshake` goes to the scheduler half.
Every step: prefill ids the scheduler released are echoed as finished sending (vLLM then
frees their blocks); prefill's partial last blocks and digest tables are written into their
slots after the forward; decode's loads go to `worker_loads`.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from transfer.agent import TransferAgent
from transfer.cache.explicit_layout import ExplicitLayout
from transfer.dataplane import make_transport
from transfer.vllm.config import PdxferConfig
from transfer.vllm.digests import DIGEST_SLOTS
from transfer.vllm.fault import hold_loads
from transfer.vllm.layout_vllm import VllmMemory, describe
from transfer.vllm.load_reads import LoadPlanner
from transfer.vllm.metadata import DigestSpec, RankHandshake, StageSpec, StepMetadata
from transfer.vllm.region_copies import RegionCopies
from transfer.vllm.stage_tail import STAGE_SLOTS, gather_copies, slot_bytes
from transfer.vllm.staging_buffer import STAGING_BYTES, StagingBuffer
from transfer.vllm.stats import PdxferStats
from transfer.vllm.vllm_caches import (
    cache_groups,
    conv_order,
    layer_index,
    layer_specs,
    model_geometry,
    vllm_version,
)
from transfer.vllm.worker_loads import DecodeLoads
from transfer.vllm.worker_verify import RankVerifier, digest_slot_bytes

logger = logging.getLogger(__name__)


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
        self.groups = cache_groups(kv_cache_config)
        self.memory: VllmMemory | None = None
        self.layouts: tuple[ExplicitLayout, ...] = ()
        self.agent: TransferAgent | None = None
        self._handshake: RankHandshake | None = None
        self._loads: DecodeLoads | None = None
        self._finished_sending: set[str] = set()
        self._unloaded: set[str] = set()  # loads that came before `register_kv_caches`
        self._copies: RegionCopies | None = None
        self._stage_out = torch.empty(0, dtype=torch.uint8)  # prefill's stage slots
        self._stage_start = 0
        self._stage_slot_bytes = 0
        self._digest_out = torch.empty(0, dtype=torch.uint8)  # prefill's digest slots (verify)
        self._digest_start = 0
        self._digest_slot_bytes = 0
        self._verifier: RankVerifier | None = None
        self.stats = PdxferStats()

    # ---- start-up -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        specs = layer_specs(self.kv_cache_config)
        layers: dict[int, tuple[Any, torch.Tensor]] = {}
        for name, view in kv_caches.items():
            if name not in specs:
                continue
            layers[layer_index(name)] = (specs[name], view)
        engine = f"vllm-{vllm_version()}"
        self.memory, regions = describe(self.geometry, self.tp, layers, conv_order(), engine)
        self.layouts = tuple(self.memory.layout(r) for r in range(self.tp))
        transport = make_transport(
            self.config.transport.value, f"pdxfer-vllm-{self.rank}-{uuid.uuid4().hex[:8]}"
        )
        self.agent = TransferAgent(transport)
        device = regions[0].device
        staging = torch.zeros(STAGING_BYTES, dtype=torch.uint8, device=device)
        self._stage_slot_bytes = slot_bytes(self.layouts[self.rank])
        self._stage_out = torch.zeros(
            max(1, STAGE_SLOTS * self._stage_slot_bytes), dtype=torch.uint8, device=device
        )
        if self.config.verify:
            self._digest_slot_bytes = digest_slot_bytes(self.layouts[self.rank])
        self._digest_out = torch.zeros(
            max(1, DIGEST_SLOTS * self._digest_slot_bytes), dtype=torch.uint8, device=device
        )
        ours = [staging, self._stage_out, self._digest_out]
        metadata = self.agent.register([*regions, *ours])
        region_map = self.agent.transport.region_map
        assert region_map is not None
        staging_start, self._stage_start, self._digest_start = (
            r.start for r in region_map.regions[len(regions) :]
        )
        self._copies = RegionCopies([*regions, *ours], region_map)
        self._verifier = RankVerifier(self.groups, self.layouts[self.rank], self._copies)
        staged = StagingBuffer(staging, staging_start)
        planner = LoadPlanner(self.groups, self.layouts, self.rank, staged, self.agent)
        self._loads = DecodeLoads(
            self.agent,
            planner,
            self._copies,
            self._verifier,
            verify=self.config.verify,
            stats=self.stats,
        )
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
            conv_order(),
        )

    def get_handshake_metadata(self) -> RankHandshake | None:
        return self._handshake

    # ---- every step ---------------------------------------------------------------------

    def start_load_kv(self, meta: StepMetadata) -> None:
        self._finished_sending.update(meta.released)
        if meta.loads and self.config.test_hold_loads_file:
            hold_loads(Path(self.config.test_hold_loads_file), [x.request_id for x in meta.loads])
        if self._loads is None:
            # vLLM registers its caches before its first step; should a load come first
            # anyway, it fails (vLLM computes the prompt itself) and the server lives.
            for load in meta.loads:
                logger.warning("pdxfer: load of %s before vLLM registered its caches",
                               load.request_id)  # fmt: skip
                self._unloaded.add(load.request_id)
            return
        if meta.peers or meta.loads:
            self._loads.start(meta.peers, meta.loads)

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
        recving: set[str] = set()
        failed, self._unloaded = self._unloaded, set()
        if self._loads is not None:
            if self.agent is not None:  # else shut down: nothing settles any more
                self._loads.poll()
            recving, failed_loads = self._loads.take_done()
            failed |= failed_loads
        sending, self._finished_sending = self._finished_sending, set()
        return KVConnectorTransferResults(sending, recving | failed, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._loads.take_error_blocks() if self._loads is not None else set()

    def get_kv_connector_stats(self) -> PdxferStats | None:
        if self.stats.is_empty():
            return None
        return self.stats.clone_and_reset()

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
