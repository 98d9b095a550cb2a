"""Triton Kimi Delta Attention: the chunked (prefill) and recurrent (decode) forms.

KDA is the gated delta rule with one log-decay per key channel, S <- diag(exp(g_t)) S, so the
intra-chunk matrices need exp(G_ac - G_bc) inside the sum over channels c, where G is the
chunk-local cumulative log-decay. Chunks of BT tokens are cut into BC=16-token sub-chunks. An
off-diagonal pair of sub-chunks (i > j) factors the decay through the first row r of sub-chunk i,
exp(G_a - G_b) = exp(G_a - G_r) exp(G_r - G_b), both arguments <= 0 (g <= 0), so it is one tl.dot
with no overflow (`kda_intra_offdiag_kernel`). A diagonal sub-chunk forms exp(G_a - G_b) per
element over a [BC, BC, BK] block, the masked arguments zeroed before exp
(`kda_intra_diag_kernel`). This gives A_kk (beta_a sum_c k_ac k_bc exp(G_ac - G_bc), b < a) and
A_qk (the same with q_a and no beta, b <= a). The rest is shared with GDN: Ai = (I + A_kk)^-1
from 16x16 inverses merged block-wise, the WY form w = Ai (beta exp(G) k), u = Ai (beta v), and
the chunk-by-chunk state recurrence v_new = u - w S, S <- diag(exp(G_last)) S +
(k exp(G_last - G))^T v_new. Last, o = scale (exp(G) q S + A_qk v_new) (`kda_output_kernel`).
The recurrent form steps token by token (`recurrent_kernel`). Precision as for GDN: fp32
intermediates, tf32 tile products for half inputs, exact fp32 for fp32 inputs, fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gdn.triton_state import recurrent_delta_rule, state_passing
from ..gdn.triton_wy import (
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

SUB_CHUNK = 16


@triton.jit
def kda_intra_offdiag_kernel(
    q, k, G, beta, Akk, Aqk, cu_seqlens, chunk_indices,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """The (i, j) sub-chunk tile of A_kk and A_qk, i > j; program p is the p-th such pair in
    row order, (1,0) (2,0) (2,1) (3,0) (3,1) (3,2), which covers up to four sub-chunks."""
    i_t, i_ij, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_i = 1 + (i_ij >= 1).to(tl.int32) + (i_ij >= 3).to(tl.int32)
    i_j = i_ij - i_i * (i_i - 1) // 2
    start, eos = chunk_span(cu_seqlens, chunk_indices, i_t, BT)
    ref = start + i_i * BC
    if ref >= eos:
        return
    i_kh = i_h // (HV // H)
    o_c = tl.arange(0, BC)
    rows_i = ref + o_c
    rows_j = start + i_j * BC + o_c
    m_i = rows_i < eos
    b_kk = tl.zeros([BC, BC], dtype=tl.float32)
    b_qk = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range((K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_ik = m_i[:, None] & m_k[None, :]
        b_gr = tl.load(G + (ref * HV + i_h) * K + o_k, mask=m_k, other=0.0)
        b_Gi = tl.load(G + (rows_i[:, None] * HV + i_h) * K + o_k[None, :], mask=m_ik, other=0.0)
        b_Gj = tl.load(
            G + (rows_j[:, None] * HV + i_h) * K + o_k[None, :], mask=m_k[None, :], other=0.0
        )
        b_di = tl.exp(tl.where(m_ik, b_Gi - b_gr[None, :], 0.0))
        kq_offs_i = (rows_i[:, None] * H + i_kh) * K + o_k[None, :]
        b_qi = tl.load(q + kq_offs_i, mask=m_ik, other=0.0).to(tl.float32) * b_di
        b_ki = tl.load(k + kq_offs_i, mask=m_ik, other=0.0).to(tl.float32) * b_di
        b_kj = tl.load(
            k + (rows_j[:, None] * H + i_kh) * K + o_k[None, :], mask=m_k[None, :], other=0.0
        )
        b_kj = tl.trans(b_kj.to(tl.float32) * tl.exp(b_gr[None, :] - b_Gj))
        b_kk += mma(b_ki, b_kj, PREC)
        b_qk += mma(b_qi, b_kj, PREC)
    b_beta = tl.load(beta + rows_i * HV + i_h, mask=m_i, other=0.0).to(tl.float32)
    offs = (rows_i[:, None] * HV + i_h) * BT + i_j * BC + o_c[None, :]
    tl.store(Akk + offs, b_kk * b_beta[:, None], mask=m_i[:, None])
    tl.store(Aqk + offs, b_qk, mask=m_i[:, None])


@triton.jit
def kda_intra_diag_kernel(
    q, k, G, beta, Akk, Aqk, cu_seqlens, chunk_indices,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """The diagonal sub-chunk tile i of A_kk (strictly lower) and A_qk (lower): every pair (a, b)
    gets its own exp(G_a - G_b) over a [BC, BC, BK] block, masked to b <= a before exp."""
    i_t, i_i, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, eos = chunk_span(cu_seqlens, chunk_indices, i_t, BT)
    first = start + i_i * BC
    if first >= eos:
        return
    i_kh = i_h // (HV // H)
    o_c = tl.arange(0, BC)
    rows = first + o_c
    m_i = rows < eos
    causal = m_i[:, None] & (o_c[None, :] <= o_c[:, None])
    b_kk = tl.zeros([BC, BC], dtype=tl.float32)
    b_qk = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range((K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_ik = m_i[:, None] & (o_k < K)[None, :]
        offs = (rows[:, None] * H + i_kh) * K + o_k[None, :]
        b_q = tl.load(q + offs, mask=m_ik, other=0.0).to(tl.float32)
        b_k = tl.load(k + offs, mask=m_ik, other=0.0).to(tl.float32)
        b_G = tl.load(G + (rows[:, None] * HV + i_h) * K + o_k[None, :], mask=m_ik, other=0.0)
        b_diff = tl.where(causal[:, :, None], b_G[:, None, :] - b_G[None, :, :], 0.0)
        b_kd = b_k[None, :, :] * tl.exp(b_diff)
        b_kk += tl.sum(b_k[:, None, :] * b_kd, 2)
        b_qk += tl.sum(b_q[:, None, :] * b_kd, 2)
    b_beta = tl.load(beta + rows * HV + i_h, mask=m_i, other=0.0).to(tl.float32)
    b_kk = tl.where(causal & (o_c[None, :] < o_c[:, None]), b_kk * b_beta[:, None], 0.0)
    b_qk = tl.where(causal, b_qk, 0.0)
    offs = (rows[:, None] * HV + i_h) * BT + i_i * BC + o_c[None, :]
    tl.store(Akk + offs, b_kk, mask=m_i[:, None])
    tl.store(Aqk + offs, b_qk, mask=m_i[:, None])


@triton.jit
def kda_output_kernel(
    q, v_new, G, Aqk, hs, o, cu_seqlens, chunk_indices, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """o = scale ((q exp(G)) S_chunk + A_qk v_new) for one chunk."""
    i_t, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_kh = i_h // (HV // H)
    start, eos = chunk_span(cu_seqlens, chunk_indices, i_t, BT)
    o_t = tl.arange(0, BT)
    rows = start + o_t
    m_t = rows < eos
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range((K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        mask = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + (rows[:, None] * H + i_kh) * K + o_k[None, :], mask=mask, other=0.0)
        b_G = tl.load(G + (rows[:, None] * HV + i_h) * K + o_k[None, :], mask=mask, other=0.0)
        b_q = b_q.to(tl.float32) * tl.exp(b_G)
        h_offs = (i_t * HV + i_h).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(hs + h_offs, mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o += mma(b_q, b_h, PREC)
    causal = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
    b_A = tl.load(Aqk + (rows[:, None] * HV + i_h) * BT + o_t[None, :], mask=causal, other=0.0)
    mask = m_t[:, None] & m_v[None, :]
    offs = (rows[:, None] * HV + i_h) * V + o_v[None, :]
    b_vn = tl.load(v_new + offs, mask=mask, other=0.0)
    b_o = (b_o + mma(b_A, b_vn, PREC)) * scale
    tl.store(o + offs, b_o.to(o.dtype.element_ty), mask=mask)


def _kda_intra(q, k, G, beta, layout: ChunkLayout, prec: str):
    """A_kk (beta folded in, strictly lower) and A_qk (lower), [T_all, HV, BT] fp32."""
    H, K = k.shape[1], k.shape[2]
    HV, BT = G.shape[1], layout.chunk_size
    Akk = torch.empty(k.shape[0], HV, BT, dtype=torch.float32, device=k.device)
    Aqk = torch.empty_like(Akk)
    NC = BT // SUB_CHUNK
    common = (q, k, G, beta, Akk, Aqk, layout.cu_seqlens, layout.chunk_indices)
    if NC > 1:
        kda_intra_offdiag_kernel[(layout.num_chunks, NC * (NC - 1) // 2, HV)](
            *common, H=H, HV=HV, K=K, BT=BT, BC=SUB_CHUNK, BK=key_block(K), PREC=prec
        )
    kda_intra_diag_kernel[(layout.num_chunks, NC, HV)](
        *common, H=H, HV=HV, K=K, BT=BT, BC=SUB_CHUNK, BK=min(32, key_block(K))
    )
    return Akk, Aqk


def triton_chunk_kda(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, chunk_size,
    cu_seqlens,
):  # fmt: skip
    """Chunked KDA on validated inputs; shapes as `kernels.kda.chunk_kda`."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    full_key_block(K)
    layout = chunk_layout(B, T, cu_seqlens, chunk_size, q.device)
    prec = dot_precision(v.dtype)
    q, k = (x.reshape(B * T, H, K).contiguous() for x in (q, k))
    if use_qk_l2norm:
        q, k = l2norm_rows(q), l2norm_rows(k)
    v = v.reshape(B * T, HV, V).contiguous()
    g = g.reshape(B * T, HV, K).contiguous()
    beta = beta.reshape(B * T, HV).contiguous()
    h0 = initial_state.contiguous() if initial_state is not None else None
    if layout.num_chunks == 0:
        final = empty_final(h0, layout, HV, K, V, q) if output_final_state else None
        return torch.empty_like(v).reshape(B, T, HV, V), final
    G = chunk_cumsum(g, layout)
    Akk, Aqk = _kda_intra(q, k, G, beta, layout, prec)
    Ai = solve_unit_lower(Akk, layout)
    w, u = wy_transform(k, v, beta, G, Ai, layout, prec)
    hs, v_new, final = state_passing(k, w, u, G, h0, output_final_state, layout, prec)
    o = torch.empty_like(v)
    BV = value_block(V)
    kda_output_kernel[(layout.num_chunks, HV, triton.cdiv(V, BV))](
        q, v_new, G, Aqk, hs, o, layout.cu_seqlens, layout.chunk_indices, scale,
        H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=min(32, key_block(K)), BV=BV, PREC=prec,
        num_warps=8,
    )  # fmt: skip
    return o.reshape(B, T, HV, V), final


def triton_recurrent_kda(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens
):
    """Recurrent KDA on validated inputs; shapes as `kernels.kda.recurrent_kda`."""
    return recurrent_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens
    )
