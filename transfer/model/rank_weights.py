"""One TP rank's weights from a checkpoint: shape-checked slices, as fp32 on the rank's device.

The slices come from `Segment.units_on_rank`, the same shard functions the geometry, the
cache layout and the packer use: one description of which heads (or FFN columns) a rank holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from transfer.errors import InvalidInput
from transfer.geometry import Segment
from transfer.model.checkpoint import Checkpoint


class RankWeights:
    """Reads rank `rank` of `tp`'s part of named tensors from `checkpoint`."""

    def __init__(
        self, checkpoint: Checkpoint, tp: int, rank: int, device: torch.device | str = "cpu"
    ) -> None:
        self.checkpoint = checkpoint
        self.tp = tp
        self.rank = rank
        self.device = torch.device(device)

    def has(self, name: str) -> bool:
        return self.checkpoint.has(name)

    def full(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A replicated tensor (norms, router, small vectors), whole."""
        self._check_shape(name, shape)
        return self._place(self.checkpoint.read(name))

    def rows(self, name: str, segments: Sequence[Segment], shape: tuple[int, ...]) -> torch.Tensor:
        """Column-parallel: the rank's part of dim 0, which concatenates `segments`."""
        return self.along(name, 0, segments, shape)

    def cols(self, name: str, segments: Sequence[Segment], shape: tuple[int, ...]) -> torch.Tensor:
        """Row-parallel: the rank's part of dim 1."""
        return self.along(name, 1, segments, shape)

    def along(
        self, name: str, dim: int, segments: Sequence[Segment], shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The rank's part of dim `dim` of a tensor of global `shape`."""
        for segment in segments:
            problem = segment.check_tp(self.tp)
            if problem:
                raise InvalidInput(f"model: tensor {name!r} cannot be sharded: {problem}")
        self._check_shape(name, shape)
        part = self.checkpoint.read_dim(name, dim, segments, self.tp, self.rank)
        return self._place(part)

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        found = self.checkpoint.shape(name)
        if found != tuple(shape):
            raise InvalidInput(
                f"model: tensor {name!r} has shape {list(found)}, expected {list(shape)}"
            )

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self.device, dtype=torch.float32).contiguous()
