"""Seeded random tensors by name, for the tiny checkpoints (`transfer.model.tiny`).

Each tensor has its own generator seeded from (seed, name), so a tensor does not depend on
which others were drawn before it: adding a tensor to a model changes no other.
"""

from __future__ import annotations

import hashlib

import torch


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class SeededTensors:
    """Draws fp32 tensors at their global shapes into `out`, keyed by name."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.out: dict[str, torch.Tensor] = {}

    def _generator(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed(_tensor_seed(self.seed, name))

    def normal(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> None:
        gen = self._generator(name)
        self.out[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    def uniform(self, name: str, shape: tuple[int, ...], low: float, high: float) -> None:
        gen = self._generator(name)
        self.out[name] = torch.rand(shape, generator=gen, dtype=torch.float32) * (high - low) + low

    def linear(self, name: str, out_features: int, in_features: int, gain: float = 1.0) -> None:
        """A `[out, in]` weight with std gain / sqrt(in)."""
        self.normal(name, (out_features, in_features), gain * in_features**-0.5)

    def swiglu(self, prefix: str, hidden: int, inter: int) -> None:
        """`{prefix}{gate,up}_proj.weight` [inter, hidden] and `down_proj.weight` [hidden, inter]."""
        self.linear(prefix + "gate_proj.weight", inter, hidden)
        self.linear(prefix + "up_proj.weight", inter, hidden)
        self.linear(prefix + "down_proj.weight", hidden, inter)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: tensor.contiguous() for name, tensor in self.out.items()}
