"""Run a plan's staging steps with the `kernels` pack ops (Triton on CUDA, torch otherwise)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transfer.packer.plan import SourcePlan

if TYPE_CHECKING:
    import torch


def gather_staging(source: SourcePlan, prefill_arena: torch.Tensor) -> None:
    """On the prefill rank, before the wire: pack `source.gather` into its staging area."""
    if not len(source.gather):
        return
    import torch

    from kernels import gather_ranges

    gather = source.gather
    start, total = int(gather.dst[0]), gather.nbytes
    gather_ranges(
        prefill_arena,
        torch.from_numpy(gather.src.copy()),
        torch.from_numpy(gather.lengths.copy()),
        out=prefill_arena[start : start + total],
    )


def scatter_staging(source: SourcePlan, decode_arena: torch.Tensor) -> None:
    """On the decode rank, after the wire: unpack its staging area into `source.scatter`."""
    if not len(source.scatter):
        return
    import torch

    from kernels import scatter_ranges

    scatter = source.scatter
    start, total = int(scatter.src[0]), scatter.nbytes
    scatter_ranges(
        decode_arena[start : start + total],
        decode_arena,
        torch.from_numpy(scatter.dst.copy()),
        torch.from_numpy(scatter.lengths.copy()),
    )
