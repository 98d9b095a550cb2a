"""Kimi Delta Attention: chunked (prefill) and recurrent (decode) ops, Triton or torch."""

from __future__ import annotations

import torch

from ..backend import use_triton
from ..gdn.args import check_chunk_size, check_delta_rule_args
from .naive import naive_chunk_kda, naive_recurrent_kda

__all__ = ["chunk_kda", "recurrent_kda"]


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA (gated delta rule with a decay per key channel) over whole sequences.

    q, k [B,T,H,K]; v [B,T,HV,V] (value head j reads key head j // (HV//H)); g (log-decay, <= 0)
    [B,T,HV,K]; beta [B,T,HV]; initial_state [N,HV,K,V] fp32 where N is B, or len(cu_seqlens)-1
    when cu_seqlens packs N sequences into B=1. Returns o [B,T,HV,V] in v's dtype and, if
    output_final_state, the final state [N,HV,K,V] fp32 (else None). scale defaults to K**-0.5.
    """
    check_delta_rule_args(q, k, v, g, beta, initial_state, cu_seqlens, g_per_key=True)
    check_chunk_size(chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm)
    if use_triton(q, k, v, g, beta, initial_state):
        from .triton import triton_chunk_kda

        return triton_chunk_kda(*args, chunk_size, cu_seqlens)
    return naive_chunk_kda(*args, chunk_size=chunk_size, cu_seqlens=cu_seqlens)


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA (decode). Shapes and results as `chunk_kda`."""
    check_delta_rule_args(q, k, v, g, beta, initial_state, cu_seqlens, g_per_key=True)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm)
    if use_triton(q, k, v, g, beta, initial_state):
        from .triton import triton_recurrent_kda

        return triton_recurrent_kda(*args, cu_seqlens)
    return naive_recurrent_kda(*args, cu_seqlens=cu_seqlens)
