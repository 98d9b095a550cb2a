"""Depthwise causal conv1d (the "Conv" of S&Conv): prefill over a sequence and the decode step."""

from __future__ import annotations

from itertools import pairwise

import torch

from kernels.backend import use_triton
from kernels.conv1d.naive import causal_conv1d_naive, causal_conv1d_update_naive

ACTIVATIONS = ("silu", None)

__all__ = ["causal_conv1d", "causal_conv1d_update"]


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv: y[t] = act(bias + sum_w weight[:, w] * x[t - (W-1) + w]).

    x [B,T,D]; weight [D,W]; bias [D]; activation "silu" or None.
    initial_state [N,D,W-1] holds the inputs before each sequence (zeros when None).
    cu_seqlens: int offsets [N+1] of N sequences packed along T (then B must be 1);
    without it N = B. Returns y [B,T,D] and, when output_final_state, the last W-1
    inputs of each sequence [N,D,W-1] (left-filled from initial_state or zeros when
    a sequence is shorter than W-1), else None.
    """
    num_seqs = _check_conv_args(x, weight, bias, activation, cu_seqlens)
    if initial_state is not None:
        _check_tensor(
            "initial_state", initial_state, (num_seqs, x.shape[2], weight.shape[1] - 1), x
        )
    args = (x, weight, bias, activation, initial_state, output_final_state, cu_seqlens)
    if use_triton(x, weight, bias, initial_state):
        from kernels.conv1d.triton import causal_conv1d_triton

        return causal_conv1d_triton(*args)
    return causal_conv1d_naive(*args)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step: x [B,D] enters the window, conv_state [B,D,W-1] shifts IN PLACE.

    conv_state may be any strided view (a slice of an arena, or a time-major
    [B,W-1,D] tensor transposed to [B,D,W-1]). Returns y [B,D].
    """
    if x.dim() != 2:
        raise ValueError(f"x: expected [B, D], got shape {tuple(x.shape)}")
    batch, dim = x.shape
    _check_weight(weight, bias, activation, dim, x)
    _check_tensor("conv_state", conv_state, (batch, dim, weight.shape[1] - 1), x)
    args = (x, conv_state, weight, bias, activation)
    if use_triton(x, conv_state, weight, bias):
        from kernels.conv1d.triton import causal_conv1d_update_triton

        return causal_conv1d_update_triton(*args)
    return causal_conv1d_update_naive(*args)


def _check_conv_args(x, weight, bias, activation, cu_seqlens) -> int:
    """Validate the prefill arguments; returns the number of sequences N."""
    if x.dim() != 3:
        raise ValueError(f"x: expected [B, T, D], got shape {tuple(x.shape)}")
    batch, seq_len, dim = x.shape
    _check_weight(weight, bias, activation, dim, x)
    if cu_seqlens is None:
        return batch
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or len(cu_seqlens) < 2:
        raise ValueError(
            f"cu_seqlens: expected int offsets [N+1] with N >= 1, got {cu_seqlens.dtype} "
            f"shape {tuple(cu_seqlens.shape)}"
        )
    if batch != 1:
        raise ValueError(f"x: with cu_seqlens the batch must be 1, got shape {tuple(x.shape)}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != seq_len or any(a > b for a, b in pairwise(bounds)):
        raise ValueError(
            f"cu_seqlens: expected non-decreasing offsets from 0 to T={seq_len}, got {bounds}"
        )
    return len(bounds) - 1


def _check_weight(weight, bias, activation, dim, x) -> None:
    if not x.dtype.is_floating_point:
        raise ValueError(f"x: expected a floating dtype, got {x.dtype}")
    if weight.dim() != 2 or weight.shape[0] != dim or weight.shape[1] < 2:
        raise ValueError(f"weight: expected [D={dim}, W>=2], got shape {tuple(weight.shape)}")
    _check_tensor("weight", weight, tuple(weight.shape), x)
    if bias is not None:
        _check_tensor("bias", bias, (dim,), x)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected 'silu' or None, got {activation!r}")


def _check_tensor(name: str, tensor: torch.Tensor, shape: tuple[int, ...], x: torch.Tensor) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(tensor.shape)}")
    if tensor.device != x.device:
        raise ValueError(f"{name}: expected device {x.device}, got {tensor.device}")
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating dtype, got {tensor.dtype}")
