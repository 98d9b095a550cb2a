"""Partial rotate-half RoPE: the first `rotary_dim` channels of each head rotate, the rest pass.

Qwen3.5's mRoPE gives text tokens the same position on its three axes, where it equals this.
"""

from __future__ import annotations

import torch


class PartialRope:
    """inv_freq[i] = theta^(-2i / rotary_dim) for i < rotary_dim / 2."""

    def __init__(
        self, head_dim: int, partial_rotary_factor: float, theta: float, device: torch.device
    ) -> None:
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        if self.rotary_dim < 2 or self.rotary_dim % 2 or self.rotary_dim > head_dim:
            raise ValueError(
                f"partial_rotary_factor: {partial_rotary_factor} x head_dim {head_dim} "
                f"gives {self.rotary_dim} rotary channels; need an even number in [2, {head_dim}]"
            )
        steps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32)
        self.inv_freq = (1.0 / theta ** (steps / self.rotary_dim)).to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] at `positions` [T] -> [T, H, D]."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq  # [T, rotary_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        cos, sin = angles.cos(), angles.sin()
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)
