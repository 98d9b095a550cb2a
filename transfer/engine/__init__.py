"""The tiny hybrid model with real tensor parallelism, reading and writing the cache arena.

Public API (what workers build on):
- `RankEngine`: one TP rank's model over its caches; prefill / decode / transfer hooks.
- `CacheAccess`, `ArenaCaches`, `LocalCaches`: the caches a `RankEngine` runs over.
- `TPGroup`, `init_tp_group`: the torch.distributed group of one model instance.
- `reference_generate`: the colocated TP=1 generation that `--verify` compares against.
- `CacheFillingError`, `SlotPhase`: the slot lifecycle (REFERENCE.md §5 bugs 4 and 6).

Names load on first access (PEP 562): importing a torch-free submodule such as
`transfer.engine.router` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transfer.engine.caches import ArenaCaches, CacheAccess, LocalCaches
    from transfer.engine.distributed import TPGroup, free_port, init_tp_group
    from transfer.engine.reference import full_sequence_logits, reference_generate
    from transfer.engine.runner import RankEngine, blocks_needed
    from transfer.engine.slots import CacheFillingError, SlotPhase

_HOMES = {
    "ArenaCaches": "transfer.engine.caches",
    "CacheAccess": "transfer.engine.caches",
    "LocalCaches": "transfer.engine.caches",
    "TPGroup": "transfer.engine.distributed",
    "free_port": "transfer.engine.distributed",
    "init_tp_group": "transfer.engine.distributed",
    "full_sequence_logits": "transfer.engine.reference",
    "reference_generate": "transfer.engine.reference",
    "RankEngine": "transfer.engine.runner",
    "blocks_needed": "transfer.engine.runner",
    "CacheFillingError": "transfer.engine.slots",
    "SlotPhase": "transfer.engine.slots",
}

__all__ = [
    "ArenaCaches",
    "CacheAccess",
    "CacheFillingError",
    "LocalCaches",
    "RankEngine",
    "SlotPhase",
    "TPGroup",
    "blocks_needed",
    "free_port",
    "full_sequence_logits",
    "init_tp_group",
    "reference_generate",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'transfer.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
