"""The chunked delta rule in Triton, shared by GDN and KDA.

Every sequence is split into chunks of BT tokens, and the chunk-local cumulative log-decay G
keeps every exp() argument non-positive. Inside a chunk the delta rule is the triangular system
(I + A) U = beta V - beta exp(G) K S0, with A_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc) for
j < i. The kind builds A (its `chunk_intra`); the shared steps then invert I + A from 16x16
diagonal inverses merged block-wise (`solve_unit_lower_kernel`), form w = Ai (beta exp(G) k),
u = Ai (beta v) (`wy_kernel`), and walk the chunks of each sequence in order with S in registers:
v_new = u - w S, S <- diag(exp(G_last)) S + (k exp(G_last - G))^T v_new (`state_passing_kernel`).
Last, every chunk is independent again: o = scale (exp(G) q S + A_qk v_new), with A_qk =
tril(sum_c q_ic k_jc exp(G_ic - G_jc)) read from the kind's intra step or, for a scalar decay,
formed in the kernel (`output_kernel`). Intermediates are fp32; tile products run on tf32
tensor cores for bf16/fp16 inputs and in exact fp32 for fp32 inputs, accumulating in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .triton_state import state_passing
from .triton_wy import (
    ChunkLayout,
    chunk_cumsum,
    chunk_layout,
    chunk_rows,
    dot_precision,
    empty_final,
    full_key_block,
    key_block,
    l2norm_rows,
    mma,
    solve_unit_lower,
    value_block,
    wy_transform,
)


@triton.jit
def output_kernel(
    q, k, v_new, G, Aqk, hs, o, cu_seqlens, chunk_indices, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PER_K: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """o = scale (exp(G) q S_chunk + A_qk v_new) for one chunk and V tile. PER_K reads A_qk;
    a scalar decay forms it here, tril(q k^T) exp(G_i - G_j), and applies exp(G) after q S."""
    i_t, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_kh = i_h // (HV // H)
    o_t, rows, m_t = chunk_rows(cu_seqlens, chunk_indices, i_t, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range((K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        mask = m_t[:, None] & m_k[None, :]
        offs_qk = (rows[:, None] * H + i_kh) * K + o_k[None, :]
        b_q = tl.load(q + offs_qk, mask=mask, other=0.0).to(tl.float32)
        if PER_K:
            b_G = tl.load(G + (rows[:, None] * HV + i_h) * K + o_k[None, :], mask=mask, other=0.0)
            b_q = b_q * tl.exp(b_G)
        else:
            b_k = tl.load(k + offs_qk, mask=mask, other=0.0).to(tl.float32)
            b_A += mma(b_q, tl.trans(b_k), PREC)
        h_offs = (i_t * HV + i_h).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(hs + h_offs, mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o += mma(b_q, b_h, PREC)
    causal = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
    if PER_K:
        b_A = tl.load(Aqk + (rows[:, None] * HV + i_h) * BT + o_t[None, :], mask=causal, other=0.0)
    else:
        b_G = tl.load(G + rows * HV + i_h, mask=m_t, other=0.0)
        b_decay = tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], 0.0))
        b_A = tl.where(causal, b_A * b_decay, 0.0)
        b_o = b_o * tl.exp(b_G)[:, None]
    mask = m_t[:, None] & m_v[None, :]
    offs = (rows[:, None] * HV + i_h) * V + o_v[None, :]
    b_vn = tl.load(v_new + offs, mask=mask, other=0.0)
    b_o = (b_o + mma(b_A, b_vn, PREC)) * scale
    tl.store(o + offs, b_o.to(o.dtype.element_ty), mask=mask)


def chunk_output(q, k, v_new, G, A_qk, hs, o, scale, layout: ChunkLayout, prec: str) -> None:
    """Writes o [T_all, HV, V]; A_qk [T_all, HV, BT] with a per-key decay, else None."""
    H, K = q.shape[1], q.shape[2]
    HV, V = v_new.shape[1], v_new.shape[2]
    per_k = G.ndim == 3
    BV = value_block(V)
    # a per-key decay holds [BT, BK] exp(G) tiles beside q: smaller K tiles keep registers low
    BK = min(32, key_block(K)) if per_k else key_block(K)
    output_kernel[(layout.num_chunks, HV, triton.cdiv(V, BV))](
        q, k, v_new, G, A_qk, hs, o, layout.cu_seqlens, layout.chunk_indices, scale,
        H=H, HV=HV, K=K, V=V, BT=layout.chunk_size, BK=BK, BV=BV, PER_K=per_k, PREC=prec,
        num_warps=8,
    )  # fmt: skip


def triton_chunk_delta_rule(
    chunk_intra: Callable, q, k, v, g, beta, scale, initial_state, output_final_state,
    use_qk_l2norm, chunk_size, cu_seqlens,
):  # fmt: skip
    """Chunked delta rule on validated inputs; shapes as `kernels.gdn.chunk_gdn`.

    chunk_intra(q, k, G, beta, layout, prec) -> (A_kk, A_qk) is the kind's, on flattened tensors
    (see `triton_wy`): [T_all, HV, BT] fp32, beta folded into A_kk, and A_qk None for a scalar
    decay.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    full_key_block(K)
    layout = chunk_layout(B, T, cu_seqlens, chunk_size, q.device)
    prec = dot_precision(v.dtype)
    q, k = (x.reshape(B * T, H, K).contiguous() for x in (q, k))
    if use_qk_l2norm:
        q, k = l2norm_rows(q), l2norm_rows(k)
    v = v.reshape(B * T, HV, V).contiguous()
    g = g.reshape(B * T, *g.shape[2:]).contiguous()
    beta = beta.reshape(B * T, HV).contiguous()
    h0 = initial_state.contiguous() if initial_state is not None else None
    if layout.num_chunks == 0:
        final = empty_final(h0, layout, HV, K, V, q) if output_final_state else None
        return torch.empty_like(v).reshape(B, T, HV, V), final
    G = chunk_cumsum(g, layout)
    A_kk, A_qk = chunk_intra(q, k, G, beta, layout, prec)
    Ai = solve_unit_lower(A_kk, layout)
    w, u = wy_transform(k, v, beta, G, Ai, layout, prec)
    hs, v_new, final = state_passing(k, w, u, G, h0, output_final_state, layout, prec)
    o = torch.empty_like(v)
    chunk_output(q, k, v_new, G, A_qk, hs, o, scale, layout, prec)
    return o.reshape(B, T, HV, V), final
