"""Mamba2 (SSD) scan: chunked (prefill) and recurrent (decode) ops, Triton or torch by backend."""

from __future__ import annotations

import torch

from ..backend import use_triton
from ..scan_args import check_chunk_size
from .args import check_mamba2_args
from .naive import naive_chunk_mamba2, naive_recurrent_mamba2

__all__ = ["chunk_mamba2", "recurrent_mamba2"]


def chunk_mamba2(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked Mamba2 scan over whole sequences (prefill).

    x [B,T,H,P]; dt [B,T,H], already biased, softplus'd and clamped by the caller; A [H]
    (negative); B, C [B,T,G,N], head h reading group h // (H//G); D [H] skip or None;
    initial_state [N_seq,H,P,N] fp32 where N_seq is B, or len(cu_seqlens)-1 when cu_seqlens packs
    sequences into B=1. Per head: S <- exp(dt A) S + dt x B^T; y = S C + D x. Returns y
    [B,T,H,P] in x's dtype and, if output_final_state, the final state [N_seq,H,P,N] fp32 (else
    None). chunk_size is 16, 32 or 64.
    """
    check_mamba2_args(x, dt, A, B, C, D, initial_state, cu_seqlens)
    check_chunk_size(chunk_size)
    args = (x, dt, A, B, C, D, initial_state, output_final_state)
    if use_triton(x, dt, A, B, C, D, initial_state):
        from .triton import triton_chunk_mamba2

        return triton_chunk_mamba2(*args, chunk_size, cu_seqlens)
    return naive_chunk_mamba2(*args, chunk_size=chunk_size, cu_seqlens=cu_seqlens)


def recurrent_mamba2(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token Mamba2 scan (decode: one or a few tokens). Shapes and results as
    `chunk_mamba2`."""
    check_mamba2_args(x, dt, A, B, C, D, initial_state, cu_seqlens)
    args = (x, dt, A, B, C, D, initial_state, output_final_state)
    if use_triton(x, dt, A, B, C, D, initial_state):
        from .triton import triton_recurrent_mamba2

        return triton_recurrent_mamba2(*args, cu_seqlens)
    return naive_recurrent_mamba2(*args, cu_seqlens=cu_seqlens)
