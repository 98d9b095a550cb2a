"""Triton state kernels shared by GDN and KDA: the inter-chunk state recurrence of the chunked
form, and the token-by-token recurrent form used by decode.

A state tile is [BK, BV] fp32 in registers (BK covers all of K; V is split over programs, since
value columns evolve independently). PER_K selects a per-key-channel decay (KDA) over a scalar
one (GDN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .args import L2NORM_EPS
from .triton_wy import ChunkLayout, full_key_block, mma, value_block


@triton.jit
def state_passing_kernel(
    k, w, u, G, hs, v_new, h0, ht, cu_seqlens, chunk_offsets,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PER_K: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Per chunk: save h, v_new = u - w h, h = exp(G_last) h + (k exp(G_last - G))^T v_new.

    A chunk is read BS rows at a time (small tiles keep shared memory low for large K): every
    row's v_new uses the chunk's entering h, and the update is a sum over rows.
    """
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_kh = i_h // (HV // H)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    first = tl.load(chunk_offsets + i_n)
    o_s = tl.arange(0, BS)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    tile = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(h0 + (i_n * HV + i_h).to(tl.int64) * K * V + tile, mask=m_h, other=0.0)
    for i_c in range((eos - bos + BT - 1) // BT):
        start = bos + i_c * BT
        tl.store(hs + ((first + i_c) * HV + i_h) * K * V + tile, b_h, mask=m_h)
        last = tl.minimum(start + BT, eos) - 1
        if PER_K:
            b_glast = tl.load(G + (last * HV + i_h) * K + o_k, mask=m_k, other=0.0)
            b_next = b_h * tl.exp(b_glast)[:, None]
        else:
            b_glast = tl.load(G + last * HV + i_h)
            b_next = b_h * tl.exp(b_glast)
        for i_s in range(BT // BS):
            rows = start + i_s * BS + o_s
            m_t = rows < eos
            m_tk = m_t[:, None] & m_k[None, :]
            m_tv = m_t[:, None] & m_v[None, :]
            b_w = tl.load(w + (rows[:, None] * HV + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
            offs_v = (rows[:, None] * HV + i_h) * V + o_v[None, :]
            b_u = tl.load(u + offs_v, mask=m_tv, other=0.0)
            b_vn = b_u - mma(b_w, b_h, PREC)
            tl.store(v_new + offs_v, b_vn, mask=m_tv)
            b_k = tl.load(k + (rows[:, None] * H + i_kh) * K + o_k[None, :], mask=m_tk, other=0.0)
            b_k = b_k.to(tl.float32)
            if PER_K:
                offs_g = (rows[:, None] * HV + i_h) * K + o_k[None, :]
                b_G = tl.load(G + offs_g, mask=m_tk, other=0.0)
                b_k = b_k * tl.exp(tl.where(m_tk, b_glast[None, :] - b_G, 0.0))
            else:
                b_G = tl.load(G + rows * HV + i_h, mask=m_t, other=0.0)
                b_k = b_k * tl.exp(tl.where(m_t, b_glast - b_G, 0.0))[:, None]
            b_next += mma(tl.trans(b_k), b_vn, PREC)
        b_h = b_next
    if STORE_FINAL:
        tl.store(ht + (i_n * HV + i_h).to(tl.int64) * K * V + tile, b_h, mask=m_h)


def state_passing(k, w, u, G, initial_state, output_final_state, layout: ChunkLayout, prec: str):
    """hs [NT, HV, K, V] (state entering each chunk), v_new [T_all, HV, V], final [N, HV, K, V]."""
    H, K = k.shape[1], k.shape[2]
    HV, V = u.shape[1], u.shape[2]
    hs = torch.empty(layout.num_chunks, HV, K, V, dtype=torch.float32, device=u.device)
    v_new = torch.empty_like(u)
    final = None
    if output_final_state:
        final = torch.empty(layout.num_seqs, HV, K, V, dtype=torch.float32, device=u.device)
    BK = full_key_block(K)
    BV = min(32, value_block(V))
    BS = min(layout.chunk_size, 16 if BK > 128 else 32)
    state_passing_kernel[(layout.num_seqs, HV, triton.cdiv(V, BV))](
        k, w, u, G, hs, v_new, initial_state, final, layout.cu_seqlens, layout.chunk_offsets,
        H=H, HV=HV, K=K, V=V, BT=layout.chunk_size, BS=BS, BK=BK, BV=BV, PER_K=G.ndim == 3,
        HAS_H0=initial_state is not None, STORE_FINAL=final is not None, PREC=prec,
        num_warps=8, num_stages=2,
    )  # fmt: skip
    return hs, v_new, final


@triton.jit
def recurrent_kernel(
    q, k, v, g, beta, o, h0, ht, cu_seqlens, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PER_K: tl.constexpr, L2NORM: tl.constexpr,
    EPS: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
):  # fmt: skip
    """One token at a time: h = exp(g) h; h += k (beta (v - h^T k))^T; o = h^T (scale q)."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_kh = i_h // (HV // H)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    tile = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(h0 + (i_n * HV + i_h).to(tl.int64) * K * V + tile, mask=m_h, other=0.0)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_kh) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * H + i_kh) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        if L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + EPS)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + EPS)
        b_v = tl.load(v + (t * HV + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + t * HV + i_h).to(tl.float32)
        if PER_K:
            b_g = tl.load(g + (t * HV + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_h = b_h * tl.exp(b_g)[:, None]
        else:
            b_h = b_h * tl.exp(tl.load(g + t * HV + i_h).to(tl.float32))
        b_delta = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
        b_h += b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0) * scale
        tl.store(o + (t * HV + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_FINAL:
        tl.store(ht + (i_n * HV + i_h).to(tl.int64) * K * V + tile, b_h, mask=m_h)


def recurrent_delta_rule(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens
):
    """Shared launcher: q, k [B,T,H,K], v [B,T,HV,V], g [B,T,HV] or [B,T,HV,K], beta [B,T,HV]."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is None:
        cu = torch.arange(B + 1, dtype=torch.int64, device=q.device) * T
    else:
        cu = cu_seqlens.to(torch.int64)
    n = cu.numel() - 1
    o = torch.empty_like(v)
    final = None
    if output_final_state:
        final = torch.empty(n, HV, K, V, dtype=torch.float32, device=v.device)
    h0 = initial_state.contiguous() if initial_state is not None else None
    BV = value_block(V)
    recurrent_kernel[(n, HV, triton.cdiv(V, BV))](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        o, h0, final, cu, scale,
        H=H, HV=HV, K=K, V=V, BK=full_key_block(K), BV=BV, PER_K=g.ndim == 4,
        L2NORM=use_qk_l2norm, EPS=L2NORM_EPS, HAS_H0=h0 is not None,
        STORE_FINAL=final is not None,
    )  # fmt: skip
    return o, final
