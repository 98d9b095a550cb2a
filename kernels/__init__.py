"""pdxfer kernels: public ops, each Triton on CUDA (or when forced) and torch otherwise.

Ops load on first access (PEP 562), so `import kernels.bench` from the CLI stays free
of torch, and one op's package never depends on another's.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kernels.backend import use_triton
    from kernels.conv1d import causal_conv1d, causal_conv1d_update
    from kernels.gdn import chunk_gdn, recurrent_gdn
    from kernels.kda import chunk_kda, recurrent_kda
    from kernels.mamba2 import chunk_mamba2, recurrent_mamba2
    from kernels.pack import (
        copy_ranges,
        gather_blocks,
        gather_ranges,
        scatter_blocks,
        scatter_ranges,
    )

_HOMES = {
    "causal_conv1d": "kernels.conv1d",
    "causal_conv1d_update": "kernels.conv1d",
    "chunk_gdn": "kernels.gdn",
    "recurrent_gdn": "kernels.gdn",
    "chunk_kda": "kernels.kda",
    "recurrent_kda": "kernels.kda",
    "chunk_mamba2": "kernels.mamba2",
    "recurrent_mamba2": "kernels.mamba2",
    "gather_ranges": "kernels.pack",
    "scatter_ranges": "kernels.pack",
    "copy_ranges": "kernels.pack",
    "gather_blocks": "kernels.pack",
    "scatter_blocks": "kernels.pack",
    "use_triton": "kernels.backend",
}

__all__ = [
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gdn",
    "recurrent_gdn",
    "chunk_kda",
    "recurrent_kda",
    "chunk_mamba2",
    "recurrent_mamba2",
    "gather_ranges",
    "scatter_ranges",
    "copy_ranges",
    "gather_blocks",
    "scatter_blocks",
    "use_triton",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
