"""`PdxferConnector`: pdxfer as a vLLM KV connector (KVConnectorBase_V1 + SupportsHMA).

vLLM builds one per process: role SCHEDULER in the engine core, role WORKER in each TP rank.
This class only dispatches each hook to the half for its role: `ConnectorScheduler`
(transfer/vllm/scheduler.py) or `ConnectorWorker` (transfer/vllm/worker.py).

    --kv-transfer-config '{"kv_connector":"PdxferConnector",
                           "kv_connector_module_path":"transfer.vllm","kv_role":"kv_both"}'
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from transfer.vllm.attn_isa import check_attention_layers
from transfer.vllm.config import PdxferConfig
from transfer.vllm.metadata import StepMetadata
from transfer.vllm.scheduler import ConnectorScheduler
from transfer.vllm.stats import PdxferPromMetrics, PdxferStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _log_through_vllm() -> None:
    """pdxfer's log lines go where vLLM's go (its handlers, its level), once per process."""
    ours, theirs = logging.getLogger("transfer"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


class PdxferConnector(KVConnectorBase_V1, SupportsHMA):
    """Moves a finished prefill's KV cache and linear-attention state to decode with pdxfer."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        self.config = PdxferConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config
        )
        self._scheduler: ConnectorScheduler | None = None
        self._worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(vllm_config, kv_cache_config, self.config)
        else:
            from transfer.vllm.worker import ConnectorWorker  # the worker half, torch-side

            self._worker = ConnectorWorker(vllm_config, kv_cache_config, self.config)

    @property
    def requires_kv_delivery(self) -> bool:
        return True  # a prefill's hand-off must not be dropped by a preemption

    # ---- scheduler side ------------------------------------------------------------------

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids  # a load restores every transfer group

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        # vLLM's only hook that keeps an idle engine stepping: control calls in flight are
        # applied in build_connector_meta (an aborted decode request's release, for one).
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._sched().set_xfer_handshake_metadata(metadata)

    # ---- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._work()
        check_attention_layers(self._vllm_config, self._kv_cache_config)
        worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._work().get_handshake_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, StepMetadata)
        self._work().start_load_kv(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads finish between steps (asynchronous), never inside a forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # decode reads from prefill's memory (partial blocks: wait_for_save)

    def wait_for_save(self) -> None:
        # After the forward: prefill gathers the partial blocks this step wrote (stage_tail)
        # and, with verify, digests the requests it finished.
        if not self.has_connector_metadata():
            return
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, StepMetadata)
        self._work().save_stages(metadata.stages)
        self._work().save_digests(metadata.digests)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self._work()
        if hasattr(worker, "get_transfer_results"):  # reports failed loads by request id too
            return worker.get_transfer_results(finished_req_ids)
        return super().get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    # ---- both ------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> PdxferStats | None:
        if self._scheduler is not None:
            return self._scheduler.get_kv_connector_stats()
        return self._worker.get_kv_connector_stats()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdxferStats:
        return PdxferStats(data=data) if data is not None else PdxferStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PdxferPromMetrics:
        return PdxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _sched(self) -> ConnectorScheduler:
        if self._scheduler is None:
            raise RuntimeError("PdxferConnector: a scheduler hook was called on a worker")
        return self._scheduler

    def _work(self) -> Any:
        if self._worker is None:
            raise RuntimeError("PdxferConnector: a worker hook was called on the scheduler")
        return self._worker
