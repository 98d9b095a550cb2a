"""What the control process hands its rank processes: torch-free, so it imports fast."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from transfer.geometry import ModelGeometry
from transfer.memplan import MemoryPlan
from transfer.serving.role import ServeRole
from transfer.sizing import CacheDtypes

# A decode rank READs this much from each prefill rank's staging area at handshake, so
# connection setup is not charged to the first request's transfer.
WARMUP_BYTES = 64
# With staging on, the staging area's first page is the warm-up target and the rest is
# the pool of staged transfers' extents.
STAGING_RESERVED_BYTES = 4096


def staging_area_bytes(staging_bytes: int) -> int:
    """A rank's staging area for a pool of `staging_bytes` (0: warm-up target only)."""
    return STAGING_RESERVED_BYTES + staging_bytes if staging_bytes else WARMUP_BYTES


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs to build itself (pickled to the spawned process)."""

    role: ServeRole  # PREFILL or DECODE
    instance_id: str
    model: str  # a preset name or a checkpoint directory
    geometry: ModelGeometry
    dtypes: CacheDtypes
    tp: int
    rank: int
    plan: MemoryPlan
    transport: str
    device: str = "cpu"
    local_rank: int = 0
    seed: int = 0
    dump_dir: str | None = None
    staging_bytes: int = 0  # the pool for staged transfers, besides the warm-up target
    env: tuple[tuple[str, str], ...] = ()  # set before the transport starts (UCX_NET_DEVICES)
    layer_group: int = 0  # LayoutOptions.layer_group: the layer-wise stream's groups
    stream_scribble_s: float = 0.0  # tests: the last rank scribbles each group this long

    @property
    def agent_name(self) -> str:
        return f"{self.instance_id}/{self.role}/rank{self.rank}"


@dataclass(frozen=True, eq=False)
class ReadBatch:
    """READs from one prefill rank, as int64 columns: `local` offsets in this rank's arena,
    `remote` offsets in the prefill rank's arena, and `nbytes` per READ."""

    prefill_rank: int
    local: np.ndarray
    remote: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)


@dataclass(frozen=True, eq=False)
class Copies:
    """Copies inside one rank's arena, as int64 columns of offsets: `src`, `dst`, `nbytes`.
    A staging gather has consecutive `dst`s, a staging scatter consecutive `src`s."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)

    @classmethod
    def empty(cls) -> Copies:
        none = np.empty(0, dtype=np.int64)
        return cls(none, none, none)


@dataclass(frozen=True)
class RankReads:
    """One decode rank's share of a transfer: its READs from each prefill rank, then the
    copies that unpack the staged part of them (empty when nothing was staged)."""

    batches: tuple[ReadBatch, ...]
    scatter: Copies = Copies.empty()

    @property
    def descriptors(self) -> int:
        return sum(len(b) for b in self.batches)
