"""Process settings of a rank that runs its model on the CPU."""

from __future__ import annotations

import os

import torch

from transfer.serving.ranks.host_malloc import keep_freed_memory


def configure_cpu_rank() -> None:
    """One torch thread (unless OMP_NUM_THREADS says otherwise), subnormals flushed to
    zero, freed memory kept in the heap."""
    if "OMP_NUM_THREADS" not in os.environ:
        # One thread per rank: ranks of both instances share the cores.
        torch.set_num_threads(1)
    # Decays drive recurrent states and exp(G) terms into subnormal floats, which x86
    # computes in microcode: flushing them to zero took 16-33 % off a prefill step's CPU
    # time (docs/benchmarks.md, "Serving") and changes only values below 1.2e-38, the
    # smallest normal float.
    torch.set_flush_denormal(True)
    keep_freed_memory()
