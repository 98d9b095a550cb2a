"""The connector's scheduler half: one instance plays both roles (vLLM's `kv_both`).

Prefill (`PrefillSide`): publishes finished prefills and serves pdxfer's TransferService.
Decode (`DecodeSide`): handshakes and acquires tickets through a `PeerClient`, orders loads,
releases.
Each step's `StepMetadata` carries decode's new loads and prefill's released ids to the workers.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from transfer.control.client import ClientOptions
from transfer.control.peer_client import PeerClient
from transfer.vllm.config import PdxferConfig, compat_fields
from transfer.vllm.metadata import RankHandshake, StepMetadata
from transfer.vllm.scheduler_decode import DecodeSide
from transfer.vllm.scheduler_groups import TransferGroups
from transfer.vllm.scheduler_prefill import PrefillSide
from transfer.vllm.stats import PdxferStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# While prefill holds finished requests' blocks for decode, vLLM counts those requests as
# unfinished and steps its engine without pause, with nothing to compute: every empty step
# wakes each TP worker. A TP-2 prefill holding one ticket so kept both cores of a 2-core
# host busy (top: its workers 98 % and 68 %, its engine core 24 %), starving its own control
# server (Heartbeat and Acquire hit their deadline, leases lapsed) and the decode server. An
# empty step while prefill only holds tickets waits this long first (the GIL released, so
# control calls run meanwhile); a new request waits at most this much longer.
IDLE_HOLD_PAUSE_S = 0.05


class ConnectorScheduler:
    """Everything `PdxferConnector` does in vLLM's scheduler process."""

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: PdxferConfig
    ):
        transfer_config = vllm_config.kv_transfer_config
        instance_id = str(transfer_config.engine_id)
        groups = TransferGroups(kv_cache_config)
        self.compat = compat_fields(vllm_config, kv_cache_config)
        self._stats = PdxferStats()
        self._stats_lock = threading.Lock()
        self.prefill = PrefillSide(
            config,
            groups,
            self.compat,
            instance_id=instance_id,
            num_blocks=kv_cache_config.num_blocks,
            max_model_len=vllm_config.model_config.max_model_len,
            tp_size=vllm_config.parallel_config.tensor_parallel_size,
            stats=self._stats,
            stats_lock=self._stats_lock,
        )
        self.peers = PeerClient(
            instance_id, ClientOptions(token=config.auth_token, timeout_s=config.control_timeout_s)
        )
        self.decode = DecodeSide(
            self.peers,
            groups,
            self.compat,
            heartbeat_s=config.heartbeat_s,
            stats=self._stats,
            stats_lock=self._stats_lock,
        )

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        handshakes = {}
        for rank, meta in metadata.items():
            if not isinstance(meta, RankHandshake):
                raise TypeError(
                    f"handshake metadata of TP rank {rank}: expected RankHandshake, "
                    f"got {type(meta).__name__}"
                )
            handshakes[rank] = meta
        self.prefill.start(handshakes)

    def on_new_request(self, request: Request) -> None:
        self.prefill.on_new_request(request)
        self.decode.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.decode.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.decode.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepMetadata:
        """The step's orders to the workers: loads, releases and tail stages."""
        idle = scheduler_output.total_num_scheduled_tokens == 0
        if idle and self.decode.idle() and self.prefill.only_holding():
            time.sleep(IDLE_HOLD_PAUSE_S)
        loads, peers = self.decode.take_loads()
        stages = self.prefill.plan_stages(scheduler_output)  # first: it records block ids
        return StepMetadata(
            loads=loads,
            released=self.prefill.take_released(),
            stages=stages,
            digests=self.prefill.plan_digests(scheduler_output),
            peers=peers,
        )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.decode.on_finished_recving(
            set(output.finished_recving or ()), set(output.failed_recving or ())
        )

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.decode.request_finished(request)
        return self.prefill.request_finished(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        return self.prefill.has_pending_frees()

    def has_pending_work(self) -> bool:
        return self.decode.has_calls_in_flight()

    def get_kv_connector_stats(self) -> PdxferStats | None:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            return self._stats.clone_and_reset()

    def shutdown(self) -> None:
        self.peers.close(wait=False)
        self.prefill.shutdown()
