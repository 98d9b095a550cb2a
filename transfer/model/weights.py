"""Deterministic random weights, drawn at the GLOBAL (TP=1) shape and then sliced per rank.

Each tensor has its own generator seeded from (seed, name), so a rank's slice does not
depend on which other tensors were drawn before it: TP=1 and TP=P are the same function.
"""

from __future__ import annotations

import hashlib

import torch

from transfer.geometry import Segment


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class WeightSource:
    """Draws named global tensors; `device` is where the rank's slices end up."""

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.seed = seed
        self.device = torch.device(device)

    def normal(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0):
        gen = torch.Generator().manual_seed(_tensor_seed(self.seed, name))
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    def uniform(self, name: str, shape: tuple[int, ...], low: float, high: float):
        gen = torch.Generator().manual_seed(_tensor_seed(self.seed, name))
        return torch.rand(shape, generator=gen, dtype=torch.float32) * (high - low) + low

    def linear(self, name: str, out_features: int, in_features: int, gain: float = 1.0):
        """A `[out, in]` weight with std gain / sqrt(in)."""
        return self.normal(name, (out_features, in_features), gain * in_features**-0.5)

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.contiguous().to(self.device)


def unit_range(segment: Segment, tp: int, rank: int) -> slice:
    """The elements (not units) of `segment` that rank `rank` of `tp` holds."""
    units = segment.units_on_rank(tp, rank)
    return slice(units.start * segment.unit_elems, units.stop * segment.unit_elems)


def shard_rows(weight: torch.Tensor, segment: Segment, tp: int, rank: int) -> torch.Tensor:
    """Column-parallel: the output rows (dim 0) of `segment` that the rank holds."""
    expected = segment.num_units * segment.unit_elems
    if weight.shape[0] != expected:
        raise ValueError(f"{segment.name}: weight has {weight.shape[0]} rows, expected {expected}")
    return weight[unit_range(segment, tp, rank)]


def shard_cols(weight: torch.Tensor, segment: Segment, tp: int, rank: int) -> torch.Tensor:
    """Row-parallel: the input columns (dim -1) of `segment` that the rank holds."""
    expected = segment.num_units * segment.unit_elems
    if weight.shape[-1] != expected:
        raise ValueError(f"{segment.name}: weight has {weight.shape[-1]} cols, expected {expected}")
    return weight[..., unit_range(segment, tp, rank)]
