"""Argument checks shared by the chunked/recurrent scans (the delta rule, Mamba2)."""

from __future__ import annotations

from itertools import pairwise

import torch

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHUNK_SIZES = (16, 32, 64)


def shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_input_dtypes(named: dict[str, torch.Tensor]) -> None:
    for name, t in named.items():
        if t.dtype not in INPUT_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} not in fp32/bf16/fp16 (shape {shape(t)})")


def check_same_dtype(ref_name: str, ref: torch.Tensor, named: dict[str, torch.Tensor]) -> None:
    for name, t in named.items():
        if t.dtype != ref.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from {ref_name}'s {ref.dtype}")


def check_devices(ref_name: str, ref: torch.Tensor, named: dict[str, torch.Tensor | None]) -> None:
    for name, t in named.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name}: on device {t.device}, but {ref_name} is on {ref.device}")


def num_sequences(cu_seqlens: torch.Tensor | None, ref_name: str, ref: torch.Tensor) -> int:
    """N: ref's batch B, or the len(cu_seqlens)-1 sequences packed along T (with B == 1)."""
    B, T = ref.shape[0], ref.shape[1]
    if cu_seqlens is None:
        return B
    if B != 1:
        raise ValueError(f"cu_seqlens: requires B == 1, got {ref_name} of shape {shape(ref)}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected [N+1] offsets, got shape {shape(cu_seqlens)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens: dtype {cu_seqlens.dtype} is not int32/int64")
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != T or any(a > b for a, b in pairwise(offsets)):
        raise ValueError(
            f"cu_seqlens: expected non-decreasing offsets from 0 to T={T}, got {offsets}"
        )
    return cu_seqlens.numel() - 1


def check_state(initial_state: torch.Tensor | None, expected: tuple[int, ...], axes: str) -> None:
    """An fp32 state of shape `expected`, whose axes are named by `axes` (e.g. "N, HV, K, V")."""
    if initial_state is None:
        return
    if shape(initial_state) != expected:
        raise ValueError(
            f"initial_state: expected shape {expected} ({axes}), got {shape(initial_state)}"
        )
    if initial_state.dtype != torch.float32:
        raise ValueError(f"initial_state: dtype {initial_state.dtype} must be torch.float32")


def check_chunk_size(chunk_size: int) -> None:
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, got {chunk_size}")
