"""Triton Gated DeltaNet: the intra-chunk matrix of its chunked form.

With one log-decay per head and token, the decay between two tokens of a chunk is one number,
exp(G_i - G_j), so A_kk is (k k^T) times a [BT, BT] decay, one tl.dot over K tiles
(`gdn_kkt_kernel`). The same holds for q k^T, which the shared output kernel therefore forms
itself, with no A_qk in memory. The other steps are in `kernels.delta_rule`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..delta_rule.triton_wy import ChunkLayout, chunk_rows, key_block, mma


@triton.jit
def gdn_kkt_kernel(
    k, G, beta, A, cu_seqlens, chunk_indices,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """A_ij = beta_i (k_i . k_j) exp(G_i - G_j) for j < i, else 0."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_kh = i_h // (HV // H)
    o_t, rows, m_t = chunk_rows(cu_seqlens, chunk_indices, i_t, BT)
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


def chunk_intra(q, k, G, beta, layout: ChunkLayout, prec: str):
    """A_kk [T_all, HV, BT] fp32 (beta folded in, strictly lower); GDN keeps no A_qk (None)."""
    H, K = k.shape[1], k.shape[2]
    HV = G.shape[1]
    A = torch.empty(k.shape[0], HV, layout.chunk_size, dtype=torch.float32, device=k.device)
    gdn_kkt_kernel[(layout.num_chunks, HV)](
        k, G, beta, A, layout.cu_seqlens, layout.chunk_indices,
        H=H, HV=HV, K=K, BT=layout.chunk_size, BK=key_block(K), PREC=prec,
    )  # fmt: skip
    return A, None
