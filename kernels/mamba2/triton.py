"""Triton Mamba2 (SSD): the chunked (prefill) and recurrent (decode) forms.

The chunked form splits every sequence into chunks of BT tokens and works with the chunk-local
cumulative log-decay Acum of a = dt A (<= 0), so every exp() below has a non-positive argument.
One program per (sequence, head, P tile) walks the chunks in order with the state tile [BP, N]
in registers, saving the state entering each chunk, then S <- exp(Acum_last) S +
(x dt exp(Acum_last - Acum))^T B (`state_passing_kernel`). Every chunk is then independent:
y = exp(Acum) (C S_chunk^T) + tril((C B^T) exp(Acum_i - Acum_j)) (dt x) + D x
(`output_kernel`). The recurrent form keeps one [BP, N] state tile per program and steps token
by token (`recurrent_kernel`). Head h reads group h // (H // G) of B and C. Intermediates are
fp32; tile products run on tf32 tensor cores for bf16/fp16 inputs and in exact fp32 for fp32
inputs, always accumulating in fp32. The chunk layout and the cumulative sum are the delta rule's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..delta_rule.triton_wy import (
    ChunkLayout,
    chunk_cumsum,
    chunk_layout,
    chunk_rows,
    dot_precision,
    empty_final,
    mma,
)

MAX_STATE_SIZE = 256


def state_block(N: int) -> int:
    """One tile holding the whole state dimension (state tiles are [BP, BN] registers)."""
    if N > MAX_STATE_SIZE:
        raise ValueError(f"B: state size N={N} exceeds {MAX_STATE_SIZE}, the Triton kernels' limit")
    return max(16, triton.next_power_of_2(N))


def head_dim_block(P: int) -> int:
    return min(32, max(16, triton.next_power_of_2(P)))


@triton.jit
def state_passing_kernel(
    x, dt, Acum, B, hs, h0, ht, cu_seqlens, chunk_offsets,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BT: tl.constexpr,
    BS: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_H0: tl.constexpr,
    STORE_FINAL: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Per chunk: save S, then S = exp(Acum_last) S + (x dt exp(Acum_last - Acum))^T B, reading
    the chunk BS rows at a time."""
    i_n, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_g = i_h // (H // G)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    first = tl.load(chunk_offsets + i_n)
    o_s = tl.arange(0, BS)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p, m_n = o_p < P, o_n < N
    m_s = m_p[:, None] & m_n[None, :]
    tile = o_p[:, None] * N + o_n[None, :]
    b_s = tl.zeros([BP, BN], dtype=tl.float32)
    if HAS_H0:
        b_s += tl.load(h0 + (i_n * H + i_h).to(tl.int64) * P * N + tile, mask=m_s, other=0.0)
    for i_c in range((eos - bos + BT - 1) // BT):
        start = bos + i_c * BT
        tl.store(hs + ((first + i_c) * H + i_h).to(tl.int64) * P * N + tile, b_s, mask=m_s)
        last = tl.minimum(start + BT, eos) - 1
        b_alast = tl.load(Acum + last * H + i_h)
        b_next = b_s * tl.exp(b_alast)
        for i_r in range(BT // BS):
            rows = start + i_r * BS + o_s
            m_t = rows < eos
            b_a = tl.load(Acum + rows * H + i_h, mask=m_t, other=0.0)
            b_dt = tl.load(dt + rows * H + i_h, mask=m_t, other=0.0)
            b_w = b_dt * tl.exp(tl.where(m_t, b_alast - b_a, 0.0))
            offs_x = (rows[:, None] * H + i_h) * P + o_p[None, :]
            b_x = tl.load(x + offs_x, mask=m_t[:, None] & m_p[None, :], other=0.0)
            b_x = b_x.to(tl.float32) * b_w[:, None]
            offs_b = (rows[:, None] * G + i_g) * N + o_n[None, :]
            b_B = tl.load(B + offs_b, mask=m_t[:, None] & m_n[None, :], other=0.0)
            b_next += mma(tl.trans(b_x), b_B.to(tl.float32), PREC)
        b_s = b_next
    if STORE_FINAL:
        tl.store(ht + (i_n * H + i_h).to(tl.int64) * P * N + tile, b_s, mask=m_s)


@triton.jit
def output_kernel(
    x, dt, Acum, B, C, D, hs, y, cu_seqlens, chunk_indices,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BT: tl.constexpr,
    BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """y = exp(Acum) (C S_chunk^T) + tril((C B^T) exp(Acum_i - Acum_j)) (dt x) + D x."""
    i_t, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_g = i_h // (H // G)
    o_t, rows, m_t = chunk_rows(cu_seqlens, chunk_indices, i_t, BT)
    o_p = i_p * BP + tl.arange(0, BP)
    m_p = o_p < P
    b_y = tl.zeros([BT, BP], dtype=tl.float32)
    b_cb = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range((N + BN - 1) // BN):
        o_n = i_k * BN + tl.arange(0, BN)
        m_n = o_n < N
        offs_bc = (rows[:, None] * G + i_g) * N + o_n[None, :]
        m_tn = m_t[:, None] & m_n[None, :]
        b_C = tl.load(C + offs_bc, mask=m_tn, other=0.0).to(tl.float32)
        b_B = tl.load(B + offs_bc, mask=m_tn, other=0.0).to(tl.float32)
        s_offs = (i_t * H + i_h).to(tl.int64) * P * N + o_p[None, :] * N + o_n[:, None]
        b_sT = tl.load(hs + s_offs, mask=m_n[:, None] & m_p[None, :], other=0.0)
        b_y += mma(b_C, b_sT, PREC)
        b_cb += mma(b_C, tl.trans(b_B), PREC)
    b_a = tl.load(Acum + rows * H + i_h, mask=m_t, other=0.0)
    b_dt = tl.load(dt + rows * H + i_h, mask=m_t, other=0.0)
    causal = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
    b_decay = tl.exp(tl.where(causal, b_a[:, None] - b_a[None, :], 0.0))
    b_cb = tl.where(causal, b_cb * b_decay * b_dt[None, :], 0.0)
    mask = m_t[:, None] & m_p[None, :]
    offs = (rows[:, None] * H + i_h) * P + o_p[None, :]
    b_x = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    b_y = b_y * tl.exp(b_a)[:, None] + mma(b_cb, b_x, PREC)
    if HAS_D:
        b_y += tl.load(D + i_h).to(tl.float32) * b_x
    tl.store(y + offs, b_y.to(y.dtype.element_ty), mask=mask)


def _flatten(x, dt, B, C):
    """[B,T,...] -> [B*T, ...] contiguous; dt as fp32."""
    batch, T = x.shape[:2]
    x, B, C = (t.reshape(batch * T, *t.shape[2:]).contiguous() for t in (x, B, C))
    return x, dt.reshape(batch * T, x.shape[1]).float().contiguous(), B, C


def triton_chunk_mamba2(x, dt, A, B, C, D, initial_state, output_final_state, chunk_size,
                        cu_seqlens):  # fmt: skip
    """Chunked Mamba2 on validated inputs; shapes as `kernels.mamba2.chunk_mamba2`."""
    batch, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    BN = state_block(N)
    layout: ChunkLayout = chunk_layout(batch, T, cu_seqlens, chunk_size, x.device)
    prec = dot_precision(x.dtype)
    x, dt, B, C = _flatten(x, dt, B, C)
    D = D.contiguous() if D is not None else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    if layout.num_chunks == 0:
        final = empty_final(h0, layout, H, P, N, x) if output_final_state else None
        return torch.empty_like(x).reshape(batch, T, H, P), final
    Acum = chunk_cumsum(dt * A.float()[None, :], layout)
    hs = torch.empty(layout.num_chunks, H, P, N, dtype=torch.float32, device=x.device)
    final = None
    if output_final_state:
        final = torch.empty(layout.num_seqs, H, P, N, dtype=torch.float32, device=x.device)
    BP = head_dim_block(P)
    state_passing_kernel[(layout.num_seqs, H, triton.cdiv(P, BP))](
        x, dt, Acum, B, hs, h0, final, layout.cu_seqlens, layout.chunk_offsets,
        H=H, G=G, P=P, N=N, BT=chunk_size, BS=min(chunk_size, 16 if BN > 128 else 32), BP=BP,
        BN=BN, HAS_H0=h0 is not None, STORE_FINAL=final is not None, PREC=prec, num_warps=4,
    )  # fmt: skip
    y = torch.empty_like(x)
    output_kernel[(layout.num_chunks, H, triton.cdiv(P, BP))](
        x, dt, Acum, B, C, D, hs, y, layout.cu_seqlens, layout.chunk_indices,
        H=H, G=G, P=P, N=N, BT=chunk_size, BP=BP, BN=min(64, BN), HAS_D=D is not None,
        PREC=prec, num_warps=4,
    )  # fmt: skip
    return y.reshape(batch, T, H, P), final


@triton.jit
def recurrent_kernel(
    x, dt, A, B, C, D, y, h0, ht, cu_seqlens,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr,
    BN: tl.constexpr, HAS_D: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
):  # fmt: skip
    """One token at a time: S = exp(dt A) S + dt x B^T; y = S C + D x."""
    i_n, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_g = i_h // (H // G)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p, m_n = o_p < P, o_n < N
    m_s = m_p[:, None] & m_n[None, :]
    tile = o_p[:, None] * N + o_n[None, :]
    b_s = tl.zeros([BP, BN], dtype=tl.float32)
    if HAS_H0:
        b_s += tl.load(h0 + (i_n * H + i_h).to(tl.int64) * P * N + tile, mask=m_s, other=0.0)
    b_A = tl.load(A + i_h).to(tl.float32)
    for t in range(bos, eos):
        b_dt = tl.load(dt + t * H + i_h)
        b_x = tl.load(x + (t * H + i_h) * P + o_p, mask=m_p, other=0.0).to(tl.float32)
        b_B = tl.load(B + (t * G + i_g) * N + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_C = tl.load(C + (t * G + i_g) * N + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_s = b_s * tl.exp(b_dt * b_A) + (b_dt * b_x)[:, None] * b_B[None, :]
        b_y = tl.sum(b_s * b_C[None, :], 1)
        if HAS_D:
            b_y += tl.load(D + i_h).to(tl.float32) * b_x
        tl.store(y + (t * H + i_h) * P + o_p, b_y.to(y.dtype.element_ty), mask=m_p)
    if STORE_FINAL:
        tl.store(ht + (i_n * H + i_h).to(tl.int64) * P * N + tile, b_s, mask=m_s)


def triton_recurrent_mamba2(x, dt, A, B, C, D, initial_state, output_final_state, cu_seqlens):
    """Recurrent Mamba2 on validated inputs; shapes as `kernels.mamba2.recurrent_mamba2`."""
    batch, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    BN = state_block(N)
    if cu_seqlens is None:
        cu = torch.arange(batch + 1, dtype=torch.int64, device=x.device) * T
    else:
        cu = cu_seqlens.to(torch.int64)
    n = cu.numel() - 1
    x, dt, B, C = _flatten(x, dt, B, C)
    D = D.contiguous() if D is not None else None
    y = torch.empty_like(x)
    final = None
    if output_final_state:
        final = torch.empty(n, H, P, N, dtype=torch.float32, device=x.device)
    h0 = initial_state.contiguous() if initial_state is not None else None
    BP = head_dim_block(P)
    recurrent_kernel[(n, H, triton.cdiv(P, BP))](
        x, dt, A.contiguous(), B, C, D, y, h0, final, cu,
        H=H, G=G, P=P, N=N, BP=BP, BN=BN, HAS_D=D is not None, HAS_H0=h0 is not None,
        STORE_FINAL=final is not None,
    )  # fmt: skip
    return y.reshape(batch, T, H, P), final
