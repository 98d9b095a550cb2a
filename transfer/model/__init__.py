"""The real architectures (Qwen3-Next / Qwen3.5, Kimi-Linear, Nemotron-H) with real tensor
parallelism, reading and writing the cache arena.

Public API (what workers build on):
- `RankEngine`: one TP rank's model over its caches; prefill / decode / transfer hooks.
- `CacheAccess`, `ArenaCaches`, `LocalCaches`: the caches a `RankEngine` runs over.
- `TPGroup`, `init_tp_group`: the torch.distributed group of one model instance.
- `reference_generate`: the colocated TP=1 generation that `--verify` compares against.
- `load_model`: one TP rank's model from a checkpoint directory or a preset name.
- `CacheFillingError`, `SlotPhase`: the slot lifecycle (docs/bugs.md, bugs 4 and 6).

Names load on first access (PEP 562): importing a torch-free submodule such as
`transfer.serving.openai.router` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transfer.model.caches import ArenaCaches, CacheAccess, LocalCaches
    from transfer.model.distributed import TPGroup, free_port, init_tp_group
    from transfer.model.loader import RankModel, load_model, model_for_geometry
    from transfer.model.reference import full_sequence_logits, reference_generate
    from transfer.model.runner import RankEngine, blocks_needed
    from transfer.model.slots import CacheFillingError, SlotPhase

_HOMES = {
    "ArenaCaches": "transfer.model.caches",
    "CacheAccess": "transfer.model.caches",
    "LocalCaches": "transfer.model.caches",
    "TPGroup": "transfer.model.distributed",
    "free_port": "transfer.model.distributed",
    "init_tp_group": "transfer.model.distributed",
    "RankModel": "transfer.model.loader",
    "load_model": "transfer.model.loader",
    "model_for_geometry": "transfer.model.loader",
    "full_sequence_logits": "transfer.model.reference",
    "reference_generate": "transfer.model.reference",
    "RankEngine": "transfer.model.runner",
    "blocks_needed": "transfer.model.runner",
    "CacheFillingError": "transfer.model.slots",
    "SlotPhase": "transfer.model.slots",
}

__all__ = [
    "ArenaCaches",
    "CacheAccess",
    "CacheFillingError",
    "LocalCaches",
    "RankEngine",
    "RankModel",
    "SlotPhase",
    "TPGroup",
    "blocks_needed",
    "free_port",
    "full_sequence_logits",
    "init_tp_group",
    "load_model",
    "model_for_geometry",
    "reference_generate",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'transfer.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
