"""The two RMSNorms of the Qwen3-Next / Qwen3.5 family, computed in fp32."""

from __future__ import annotations

import torch

from transfer.model.row_invariant import silu


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x̂·(1 + w): every RMSNorm of these models except the gated one (w starts at zero)."""
    return rms_normalize(x, eps) * (1.0 + weight)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x̂·w·silu(gate), the GDN output norm: a plain weight, the gate applied after the norm."""
    return rms_normalize(x, eps) * weight * silu(gate.float())
