"""The control-process side of a prefill or decode instance: its ranks, pools and identity.

Both sides of a transfer must agree on the KV block size, but a memory plan picks it from
the page sizes, which depend on TP. So an instance takes the block size a TP=1 plan picks
(vLLM policy: the smallest block whose KV page covers the state page) and plans its own
TP with that exact block size; per-rank state shrinks at least as fast as per-rank KV with
TP, so the block still covers the state page and the plan keeps it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
from dataclasses import dataclass

from transfer.cache.layout import Layout
from transfer.cache.pools import CachePools
from transfer.cache.prefix_cache import PrefixCache
from transfer.cache.staging_pool import PAGE_BYTES as STAGING_PAGE_BYTES
from transfer.cache.staging_pool import StagingPool
from transfer.control.types import make_compat
from transfer.errors import InvalidInput
from transfer.geometry import ModelGeometry
from transfer.memplan import MemoryPlan, PagePolicy, plan_memory
from transfer.serving.engine.checkpoints import PREFIX_UNIT
from transfer.serving.engine.serve_options import as_enum, serve_default
from transfer.serving.ranks.commands import Info
from transfer.serving.ranks.progress import TransferMode
from transfer.serving.ranks.ranks import RankGroup
from transfer.serving.ranks.spec import STAGING_RESERVED_BYTES, RankSpec
from transfer.serving.role import INSTANCE_ROLES, ServeRole
from transfer.sizing import CacheDtypes
from transfer.units import parse_size

logger = logging.getLogger(__name__)

BUILD_RANK_WORKER = "transfer.serving.ranks.rank_worker:build_rank_worker"


@dataclass(frozen=True)
class InstanceConfig:
    role: ServeRole  # PREFILL or DECODE
    geometry: ModelGeometry
    tp: int = serve_default("tp")
    transport: str = serve_default("transport")
    device: str = serve_default("device")
    budget_bytes: int = parse_size(serve_default("gpu_mem"), "gpu_mem")
    max_seqs: int = serve_default("max_seqs")
    max_queue: int = serve_default("max_queue")  # requests waiting for room beyond max_seqs
    min_block_size: int = serve_default("block_size")
    seed: int = serve_default("seed")
    dump_dir: str | None = None
    nnodes: int = serve_default("nnodes")
    node_rank: int = serve_default("node_rank")
    dist_addr: str | None = None
    net_device: str | None = None  # UCX_NET_DEVICES for the data plane
    agent_prefix: str = ""  # names this node's data-plane agents; "" = unique per instance
    model: str = ""  # a preset name or a checkpoint directory; "" = geometry.name
    # the recurrent state's dtype; auto = the config's, else the model's
    ssm_dtype: str = serve_default("ssm_dtype")
    # prompt tokens per prefill step (longer ones chunk)
    max_num_batched_tokens: int = serve_default("max_num_batched_tokens")
    staging_bytes: int = serve_default("staging_mib") << 20  # per rank (0: every READ is direct)
    # stage a source's small ranges once it has this many
    staging_min_ranges: int = serve_default("staging_min_ranges")
    staging_min_packed: int = serve_default("staging_min_packed")
    prefix_cache: bool = serve_default("prefix_cache")  # keep full KV blocks by hash
    state_checkpoints: int = serve_default("state_checkpoints")  # prefill with a prefix cache
    # also checkpoint every this many prompt tokens (0: ends only)
    checkpoint_interval: int = serve_default("checkpoint_interval")
    transfer_mode: TransferMode = serve_default("transfer_mode")  # docs/streaming.md
    stream_layers: int = serve_default("stream_layers")  # layers per streaming group (layerwise)
    stream_scribble_s: float = 0.0  # tests only: see ProgressWriter

    def __post_init__(self) -> None:
        if self.role not in INSTANCE_ROLES:
            raise InvalidInput(f"role: must be prefill or decode, got {self.role!r}")
        object.__setattr__(self, "role", ServeRole(self.role))
        object.__setattr__(
            self, "transfer_mode", as_enum(TransferMode, self.transfer_mode, "transfer_mode")
        )
        for name in ("tp", "max_seqs", "min_block_size", "nnodes", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise InvalidInput(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise InvalidInput(f"max_queue: must be >= 0, got {self.max_queue}")
        if self.staging_bytes < 0 or self.staging_bytes % STAGING_PAGE_BYTES:
            raise InvalidInput(
                f"staging_bytes: must be a multiple of {STAGING_PAGE_BYTES} >= 0, "
                f"got {self.staging_bytes}"
            )
        if self.state_checkpoints < (
            1 if self.prefix_cache and self.role is ServeRole.PREFILL else 0
        ):
            raise InvalidInput(
                f"state_checkpoints: a prefill prefix cache needs >= 1, got {self.state_checkpoints}"
            )
        if self.checkpoint_interval < 0 or self.checkpoint_interval % PREFIX_UNIT:
            raise InvalidInput(
                f"checkpoint_interval: must be a multiple of {PREFIX_UNIT} tokens >= 0, "
                f"got {self.checkpoint_interval}"
            )
        if self.stream_layers < 1:
            raise InvalidInput(f"stream_layers: must be >= 1, got {self.stream_layers}")
        if self.staging_min_ranges < 1:
            raise InvalidInput(f"staging_min_ranges: must be >= 1, got {self.staging_min_ranges}")
        if self.staging_min_packed < 1:
            raise InvalidInput(f"staging_min_packed: must be >= 1, got {self.staging_min_packed}")
        if self.tp % self.nnodes:
            raise InvalidInput(f"nnodes: {self.nnodes} must divide tp {self.tp}")
        if not 0 <= self.node_rank < self.nnodes:
            raise InvalidInput(f"node_rank: must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_addr:
            raise InvalidInput("dist_addr: HOST:PORT is required when nnodes > 1")
        self.geometry.check_tp(self.tp)

    @property
    def checkpoint_slots(self) -> int:
        """State slots the plan reserves for checkpoints (a prefill prefix cache only: the
        state always crosses whole to decode)."""
        return self.state_checkpoints if self.prefix_cache and self.role is ServeRole.PREFILL else 0

    @property
    def layer_group(self) -> int:
        """The layout's streaming groups (0, the default layout, unless streaming)."""
        return self.stream_layers if self.transfer_mode is TransferMode.LAYERWISE else 0

    @property
    def model_source(self) -> str:
        return self.model or self.geometry.name

    @property
    def cache_dtypes(self) -> CacheDtypes:
        return CacheDtypes.for_model(self.geometry, self.ssm_dtype)

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0


def plan_for(config: InstanceConfig) -> MemoryPlan:
    """The memory plan of one rank, with a block size that does not depend on TP."""
    geometry, budget = config.geometry, config.budget_bytes
    common = dict(
        dtypes=config.cache_dtypes,
        page_policy=PagePolicy.VLLM,
        checkpoint_slots=config.checkpoint_slots,
    )
    block = plan_memory(geometry, 1, budget, config.max_seqs, config.min_block_size, **common)
    plan = plan_memory(
        geometry,
        config.tp,
        budget,
        config.max_seqs,
        block.block_size,
        alignment=block.block_size,
        **common,
    )
    if plan.block_size != block.block_size:
        raise InvalidInput(
            f"tp: at {config.tp} the memory plan wants {plan.block_size}-token blocks, "
            f"TP=1 wants {block.block_size}; raise min_block_size to {plan.block_size}"
        )
    return plan


def rank_specs(config: InstanceConfig, plan: MemoryPlan) -> list[RankSpec]:
    """This node's ranks."""
    per_node = config.tp // config.nnodes
    # A decode side tells its peers apart by agent name, so two instances must never share
    # one: host and pid alone do not separate two instances in one process (tests, benches)
    # or containers that reuse a hostname and pid.
    unique = f"{config.role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    prefix = config.agent_prefix or unique
    env = (("UCX_NET_DEVICES", config.net_device),) if config.net_device else ()
    return [
        RankSpec(
            role=config.role,
            instance_id=prefix,
            model=config.model_source,
            geometry=config.geometry,
            dtypes=config.cache_dtypes,
            tp=config.tp,
            rank=rank,
            plan=plan,
            transport=config.transport,
            device=config.device,
            local_rank=rank - config.node_rank * per_node,
            seed=config.seed,
            dump_dir=config.dump_dir,
            staging_bytes=config.staging_bytes,
            env=env,
            layer_group=config.layer_group,
            stream_scribble_s=config.stream_scribble_s,
        )
        for rank in range(config.node_rank * per_node, (config.node_rank + 1) * per_node)
    ]


class Instance:
    """Starts this node's ranks; on the leader node also the pools and the handshake identity."""

    def __init__(self, config: InstanceConfig) -> None:
        self.config = config
        self.plan = plan_for(config)
        dist_init = f"tcp://{config.dist_addr}" if config.dist_addr and config.tp > 1 else None
        self.ranks = RankGroup(
            rank_specs(config, self.plan),
            BUILD_RANK_WORKER,
            dist_init=dist_init,
            label=f"{config.role} ranks",
        )
        if not config.is_leader:
            return
        try:
            infos = self.ranks.call(Info())
        except Exception:
            self.ranks.close()
            raise
        self.rank_metadata = tuple(info.metadata for info in infos)
        self.rank_layouts = tuple(info.layout for info in infos)
        self.layouts = tuple(Layout.from_dict(json.loads(b)) for b in self.rank_layouts)
        self.pools = CachePools.from_plan(self.plan)
        self.staging = StagingPool(self.layouts[0].staging_bytes, STAGING_RESERVED_BYTES)
        self.prefix = self._prefix_cache()
        fields = self.layouts[0].compat_fields()
        self.compat = make_compat(**{k: str(v) for k, v in fields.items()})
        logger.info(
            "%s: tp %d, %d KV blocks of %d tokens, %d state slots, %s transport",
            config.role,
            config.tp,
            self.plan.num_kv_blocks,
            self.plan.block_size,
            self.plan.num_state_slots,
            config.transport,
        )

    def _prefix_cache(self) -> PrefixCache | None:
        if not self.config.prefix_cache:
            return None
        # Prefill matches 64-token units (a hit may end inside a block, whose rows it then
        # copies); decode keeps whole blocks only, because the state crosses whole.
        unit = PREFIX_UNIT if self.config.role is ServeRole.PREFILL else self.plan.block_size
        prefix = PrefixCache(
            self.pools.blocks, self.plan.block_size, self.plan.checkpoint_slot_ids, unit=unit
        )
        self.pools.evictor = prefix.evict
        return prefix

    @property
    def block_size(self) -> int:
        return self.plan.block_size

    @property
    def free_kv_blocks(self) -> int:
        """KV blocks an allocation can have: free ones, and cached ones no request holds
        (the prefix cache evicts them on demand). A leaked block counts in neither."""
        evictable = self.prefix.evictable_blocks if self.prefix is not None else 0
        return self.pools.blocks.num_free + evictable

    def close(self) -> None:
        self.ranks.close()
