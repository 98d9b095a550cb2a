"""Triton Kimi Delta Attention: the intra-chunk matrices of its chunked form.

With S <- diag(exp(g_t)) S, the intra-chunk matrices need exp(G_ac - G_bc) inside the sum over
channels c, where G is the chunk-local cumulative log-decay. Chunks of BT tokens are cut into
BC=16-token sub-chunks. An off-diagonal pair of sub-chunks (i > j) factors the decay through the
first row r of sub-chunk i, exp(G_a - G_b) = exp(G_a - G_r) exp(G_r - G_b), both arguments <= 0
(g <= 0), so it is one tl.dot with no overflow (`kda_intra_offdiag_kernel`). A diagonal
sub-chunk forms exp(G_a - G_b) per element over a [BC, BC, BK] block, the masked arguments zeroed
before exp (`kda_intra_diag_kernel`). This gives A_kk (beta_a sum_c k_ac k_bc exp(G_ac - G_bc),
b < a) and A_qk (the same with q_a and no beta, b <= a), which the shared output kernel reads.
The other steps are in `kernels.delta_rule`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..delta_rule.triton_wy import ChunkLayout, chunk_span, key_block, mma

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


def chunk_intra(q, k, G, beta, layout: ChunkLayout, prec: str):
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
