"""Triton Gated DeltaNet: the chunked (prefill) and recurrent (decode) forms.

The chunked form splits every sequence into chunks of BT tokens and works with the chunk-local
cumulative log-decay G (so every exp() below has a non-positive argument). Inside a chunk the
delta rule is the triangular system (I + A) U = beta V - beta exp(G) K S0, with
A_ij = beta_i (k_i . k_j) exp(G_i - G_j) for j < i (`gdn_kkt_kernel`, tl.dot over K tiles). Its
inverse Ai comes from 16x16 diagonal inverses merged block-wise (`solve_unit_lower_kernel`), which
gives the WY/UT form w = Ai (beta exp(G) k), u = Ai (beta v) (`wy_kernel`). One program per
(sequence, head, V tile) then walks the chunks in order, keeping S in registers:
v_new = u - w S, S <- exp(G_last) S + (k exp(G_last - G))^T v_new (`state_passing_kernel`).
Last, every chunk is independent again: o = scale (exp(G) q S + tril(q k^T exp(G_i - G_j)) v_new)
(`gdn_output_kernel`). The recurrent form keeps one [K, BV] state tile per program and steps
token by token (`recurrent_kernel`). Intermediates are fp32; tile products run on tf32 tensor
cores for bf16/fp16 inputs and in exact fp32 for fp32 inputs, always accumulating in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_state import recurrent_delta_rule, state_passing
from .triton_wy import (
    ChunkLayout,
    chunk_cumsum,
    chunk_layout,
    chunk_span,
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
def gdn_kkt_kernel(
    k, G, beta, A, cu_seqlens, chunk_indices,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """A_ij = beta_i (k_i . k_j) exp(G_i - G_j) for j < i, else 0."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_kh = i_h // (HV // H)
    start, eos = chunk_span(cu_seqlens, chunk_indices, i_t, BT)
    o_t = tl.arange(0, BT)
    rows = start + o_t
    m_t = rows < eos
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range((K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        mask = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + (rows[:, None] * H + i_kh) * K + o_k[None, :], mask=mask, other=0.0)
        b_k = b_k.to(tl.float32)
        b_A += mma(b_k, tl.trans(b_k), PREC)
    b_G = tl.load(G + rows * HV + i_h, mask=m_t, other=0.0)
    b_beta = tl.load(beta + rows * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
    strict = m_t[:, None] & (o_t[None, :] < o_t[:, None])
    b_decay = tl.exp(tl.where(strict, b_G[:, None] - b_G[None, :], 0.0))
    b_A = tl.where(strict, b_A * b_decay * b_beta[:, None], 0.0)
    tl.store(A + (rows[:, None] * HV + i_h) * BT + o_t[None, :], b_A, mask=m_t[:, None])


@triton.jit
def gdn_output_kernel(
    q, k, v_new, G, hs, o, cu_seqlens, chunk_indices, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """o = scale (exp(G) q S_chunk + tril(q k^T exp(G_i - G_j)) v_new) for one chunk."""
    i_t, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_kh = i_h // (HV // H)
    start, eos = chunk_span(cu_seqlens, chunk_indices, i_t, BT)
    o_t = tl.arange(0, BT)
    rows = start + o_t
    m_t = rows < eos
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range((K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        mask = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + (rows[:, None] * H + i_kh) * K + o_k[None, :], mask=mask, other=0.0)
        b_k = tl.load(k + (rows[:, None] * H + i_kh) * K + o_k[None, :], mask=mask, other=0.0)
        b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
        h_offs = (i_t * HV + i_h).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(hs + h_offs, mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o += mma(b_q, b_h, PREC)
        b_A += mma(b_q, tl.trans(b_k), PREC)
    b_G = tl.load(G + rows * HV + i_h, mask=m_t, other=0.0)
    causal = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
    b_A = tl.where(causal, b_A * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
    mask = m_t[:, None] & m_v[None, :]
    offs = (rows[:, None] * HV + i_h) * V + o_v[None, :]
    b_vn = tl.load(v_new + offs, mask=mask, other=0.0)
    b_o = (b_o * tl.exp(b_G)[:, None] + mma(b_A, b_vn, PREC)) * scale
    tl.store(o + offs, b_o.to(o.dtype.element_ty), mask=mask)


def _gdn_kkt(k, G, beta, layout: ChunkLayout, prec: str) -> torch.Tensor:
    H, K = k.shape[1], k.shape[2]
    HV = G.shape[1]
    A = torch.empty(k.shape[0], HV, layout.chunk_size, dtype=torch.float32, device=k.device)
    gdn_kkt_kernel[(layout.num_chunks, HV)](
        k, G, beta, A, layout.cu_seqlens, layout.chunk_indices,
        H=H, HV=HV, K=K, BT=layout.chunk_size, BK=key_block(K), PREC=prec,
    )  # fmt: skip
    return A


def triton_chunk_gdn(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, chunk_size,
    cu_seqlens,
):  # fmt: skip
    """Chunked GDN on validated inputs; shapes as `kernels.gdn.chunk_gdn`."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    full_key_block(K)
    layout = chunk_layout(B, T, cu_seqlens, chunk_size, q.device)
    prec = dot_precision(v.dtype)
    q, k = (x.reshape(B * T, H, K).contiguous() for x in (q, k))
    if use_qk_l2norm:
        q, k = l2norm_rows(q), l2norm_rows(k)
    v = v.reshape(B * T, HV, V).contiguous()
    g, beta = (x.reshape(B * T, HV).contiguous() for x in (g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    if layout.num_chunks == 0:
        final = empty_final(h0, layout, HV, K, V, q) if output_final_state else None
        return torch.empty_like(v).reshape(B, T, HV, V), final
    G = chunk_cumsum(g, layout)
    Ai = solve_unit_lower(_gdn_kkt(k, G, beta, layout, prec), layout)
    w, u = wy_transform(k, v, beta, G, Ai, layout, prec)
    hs, v_new, final = state_passing(k, w, u, G, h0, output_final_state, layout, prec)
    o = torch.empty_like(v)
    BV = value_block(V)
    gdn_output_kernel[(layout.num_chunks, HV, triton.cdiv(V, BV))](
        q, k, v_new, G, hs, o, layout.cu_seqlens, layout.chunk_indices, scale,
        H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=key_block(K), BV=BV, PREC=prec, num_warps=8,
    )  # fmt: skip
    return o.reshape(B, T, HV, V), final


def triton_recurrent_gdn(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens
):
    """Recurrent GDN on validated inputs; shapes as `kernels.gdn.recurrent_gdn`."""
    return recurrent_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens
    )
