"""Triton building blocks shared by the chunked GDN and KDA kernels: the chunk layout, l2norm,
chunk-local cumulative decay, the unit-lower-triangular inverse and the WY (w, u) transform.

Tensors are token-major and flattened over the batch: q, k [T_all, H, K], v [T_all, HV, V],
g/G [T_all, HV] (scalar decay) or [T_all, HV, K] (per-key decay), beta [T_all, HV], and the
chunk matrices A, Ai [T_all, HV, BT] (row t holds its chunk's row, columns 0..BT-1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .args import L2NORM_EPS

MAX_HEAD_K_DIM = 256


@dataclass(frozen=True)
class ChunkLayout:
    """Where every chunk lies: sequence n spans tokens cu_seqlens[n]:cu_seqlens[n+1].

    chunk_indices [NT, 2] int32 holds (sequence, chunk within sequence) per global chunk;
    chunk_offsets [N+1] int64 holds each sequence's first global chunk.
    """

    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    num_seqs: int
    num_chunks: int
    chunk_size: int


def chunk_layout(
    batch: int, seqlen: int, cu_seqlens: torch.Tensor | None, chunk_size: int, device
) -> ChunkLayout:
    if cu_seqlens is None:
        offsets = [b * seqlen for b in range(batch + 1)]
    else:
        offsets = cu_seqlens.tolist()
    counts = [triton.cdiv(eos - bos, chunk_size) for bos, eos in zip(offsets, offsets[1:])]
    indices = [(n, c) for n, count in enumerate(counts) for c in range(count)]
    firsts = [0]
    for count in counts:
        firsts.append(firsts[-1] + count)
    return ChunkLayout(
        cu_seqlens=torch.tensor(offsets, dtype=torch.int64, device=device),
        chunk_indices=torch.tensor(indices, dtype=torch.int32, device=device).reshape(-1, 2),
        chunk_offsets=torch.tensor(firsts, dtype=torch.int64, device=device),
        num_seqs=len(counts),
        num_chunks=len(indices),
        chunk_size=chunk_size,
    )


def empty_final(h0, layout: ChunkLayout, HV: int, K: int, V: int, like: torch.Tensor):
    """The final state when there are no tokens at all: the initial state, or zeros."""
    if h0 is not None:
        return h0.clone()
    return torch.zeros(layout.num_seqs, HV, K, V, dtype=torch.float32, device=like.device)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep fp32 products; half-precision inputs may use tf32 tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def key_block(K: int) -> int:
    """Width of the K tiles that loop over the key dimension."""
    return min(64, max(16, triton.next_power_of_2(K)))


def full_key_block(K: int) -> int:
    """One tile holding the whole key dimension (states are kept as [BK, BV] registers)."""
    if K > MAX_HEAD_K_DIM:
        raise ValueError(f"q: head_k_dim K={K} exceeds {MAX_HEAD_K_DIM}, the Triton kernels' limit")
    return max(16, triton.next_power_of_2(K))


def value_block(V: int) -> int:
    return min(64, max(16, triton.next_power_of_2(V)))


@triton.jit
def chunk_span(cu_seqlens, chunk_indices, i_t, BT: tl.constexpr):
    """First token of global chunk i_t and the end token of its sequence."""
    i_n = tl.load(chunk_indices + i_t * 2)
    i_c = tl.load(chunk_indices + i_t * 2 + 1)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    return bos + i_c * BT, eos


@triton.jit
def l2norm_kernel(x, y, n_rows, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, EPS: tl.constexpr):
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BD)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    offs = rows[:, None] * D + cols[None, :]
    b_x = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    b_y = b_x / tl.sqrt(tl.sum(b_x * b_x, 1) + EPS)[:, None]
    tl.store(y + offs, b_y, mask=mask)


def l2norm_rows(x: torch.Tensor) -> torch.Tensor:
    """fp32 x / sqrt(sum(x^2) + eps) over the last dim."""
    D = x.shape[-1]
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n_rows = x.numel() // D
    BR = 16
    l2norm_kernel[(triton.cdiv(n_rows, BR),)](
        x, y, n_rows, D=D, BD=triton.next_power_of_2(D), BR=BR, EPS=L2NORM_EPS
    )
    return y


@triton.jit
def chunk_cumsum_kernel(
    g, G, cu_seqlens, chunk_indices,
    HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PER_K: tl.constexpr,
):  # fmt: skip
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    start, eos = chunk_span(cu_seqlens, chunk_indices, i_t, BT)
    rows = start + tl.arange(0, BT)
    m_t = rows < eos
    if PER_K:
        o_k = tl.arange(0, BK)
        offs = (rows[:, None] * HV + i_h) * K + o_k[None, :]
        mask = m_t[:, None] & (o_k < K)[None, :]
    else:
        offs = rows * HV + i_h
        mask = m_t
    b_g = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(G + offs, tl.cumsum(b_g, axis=0), mask=mask)


def chunk_cumsum(g: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """Chunk-local inclusive cumsum of the log-decay, fp32 (restarts at every chunk)."""
    per_k = g.ndim == 3
    HV = g.shape[1]
    K = g.shape[2] if per_k else 1
    G = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    chunk_cumsum_kernel[(layout.num_chunks, HV)](
        g, G, layout.cu_seqlens, layout.chunk_indices,
        HV=HV, K=K, BT=layout.chunk_size, BK=triton.next_power_of_2(K), PER_K=per_k,
    )  # fmt: skip
    return G


@triton.jit
def _inverse_unit_lower_16(a):
    """(I + a)^-1 for a strictly lower [16, 16] tile, by forward substitution on rows."""
    o = tl.arange(0, 16)
    eye = (o[:, None] == o[None, :]).to(tl.float32)
    t = eye
    for i in range(1, 16):
        a_i = tl.sum(tl.where(o[:, None] == i, a, 0.0), 0)
        t_i = tl.sum(a_i[:, None] * t, 0)
        t = tl.where(o[:, None] == i, eye - t_i[None, :], t)
    return t


@triton.jit
def _load_tile(A, start, eos, i_h, HV: tl.constexpr, BT: tl.constexpr, bi: tl.constexpr, bj: tl.constexpr):
    o = tl.arange(0, 16)
    rows = start + bi * 16 + o
    mask = (rows < eos)[:, None] & ((start + bj * 16 + o) < eos)[None, :]
    return tl.load(A + (rows[:, None] * HV + i_h) * BT + bj * 16 + o[None, :], mask=mask, other=0.0)


@triton.jit
def _store_tile(Ai, t, start, eos, i_h, HV: tl.constexpr, BT: tl.constexpr, bi: tl.constexpr, bj: tl.constexpr):
    o = tl.arange(0, 16)
    rows = start + bi * 16 + o
    tl.store(Ai + (rows[:, None] * HV + i_h) * BT + bj * 16 + o[None, :], t, mask=(rows < eos)[:, None])


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def solve_unit_lower_kernel(A, Ai, cu_seqlens, chunk_indices, HV: tl.constexpr, BT: tl.constexpr):
    """Ai = (I + A)^-1 per chunk: invert the 16x16 diagonal tiles, then merge the off-diagonal
    tiles with Ai_ij = -Ai_ii sum_{j<=m<i} A_im Ai_mj. Upper tiles of Ai are left unwritten."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    start, eos = chunk_span(cu_seqlens, chunk_indices, i_t, BT)
    a00 = _load_tile(A, start, eos, i_h, HV, BT, 0, 0)
    t00 = _inverse_unit_lower_16(a00)
    _store_tile(Ai, t00, start, eos, i_h, HV, BT, 0, 0)
    if BT >= 32:
        t11 = _inverse_unit_lower_16(_load_tile(A, start, eos, i_h, HV, BT, 1, 1))
        a10 = _load_tile(A, start, eos, i_h, HV, BT, 1, 0)
        t10 = -_mm(_mm(t11, a10), t00)
        _store_tile(Ai, t11, start, eos, i_h, HV, BT, 1, 1)
        _store_tile(Ai, t10, start, eos, i_h, HV, BT, 1, 0)
    if BT >= 64:
        t22 = _inverse_unit_lower_16(_load_tile(A, start, eos, i_h, HV, BT, 2, 2))
        t33 = _inverse_unit_lower_16(_load_tile(A, start, eos, i_h, HV, BT, 3, 3))
        a20 = _load_tile(A, start, eos, i_h, HV, BT, 2, 0)
        a21 = _load_tile(A, start, eos, i_h, HV, BT, 2, 1)
        a30 = _load_tile(A, start, eos, i_h, HV, BT, 3, 0)
        a31 = _load_tile(A, start, eos, i_h, HV, BT, 3, 1)
        a32 = _load_tile(A, start, eos, i_h, HV, BT, 3, 2)
        t21 = -_mm(_mm(t22, a21), t11)
        t32 = -_mm(_mm(t33, a32), t22)
        t20 = -_mm(t22, _mm(a20, t00) + _mm(a21, t10))
        t31 = -_mm(t33, _mm(a31, t11) + _mm(a32, t21))
        t30 = -_mm(t33, _mm(a30, t00) + _mm(a31, t10) + _mm(a32, t20))
        _store_tile(Ai, t22, start, eos, i_h, HV, BT, 2, 2)
        _store_tile(Ai, t33, start, eos, i_h, HV, BT, 3, 3)
        _store_tile(Ai, t20, start, eos, i_h, HV, BT, 2, 0)
        _store_tile(Ai, t21, start, eos, i_h, HV, BT, 2, 1)
        _store_tile(Ai, t30, start, eos, i_h, HV, BT, 3, 0)
        _store_tile(Ai, t31, start, eos, i_h, HV, BT, 3, 1)
        _store_tile(Ai, t32, start, eos, i_h, HV, BT, 3, 2)


def solve_unit_lower(A: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """(I + A)^-1 per chunk for strictly lower A [T_all, HV, BT]; the upper part is garbage."""
    Ai = torch.empty_like(A)
    solve_unit_lower_kernel[(layout.num_chunks, A.shape[1])](
        A, Ai, layout.cu_seqlens, layout.chunk_indices, HV=A.shape[1], BT=layout.chunk_size
    )
    return Ai


@triton.jit
def wy_kernel(
    k, v, beta, G, Ai, w, u, cu_seqlens, chunk_indices,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PER_K: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """w = Ai (beta * exp(G) * k), u = Ai (beta * v) for one chunk and value head."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_kh = i_h // (HV // H)
    start, eos = chunk_span(cu_seqlens, chunk_indices, i_t, BT)
    o_t = tl.arange(0, BT)
    rows = start + o_t
    m_t = rows < eos
    lower = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
    b_Ai = tl.load(Ai + (rows[:, None] * HV + i_h) * BT + o_t[None, :], mask=lower, other=0.0)
    b_beta = tl.load(beta + rows * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        mask = m_t[:, None] & (o_v < V)[None, :]
        offs = (rows[:, None] * HV + i_h) * V + o_v[None, :]
        b_v = tl.load(v + offs, mask=mask, other=0.0).to(tl.float32) * b_beta[:, None]
        tl.store(u + offs, tl.dot(b_Ai, b_v, input_precision=PREC), mask=mask)
    if not PER_K:
        b_decay = tl.exp(tl.load(G + rows * HV + i_h, mask=m_t, other=0.0))
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        mask = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + (rows[:, None] * H + i_kh) * K + o_k[None, :], mask=mask, other=0.0)
        b_k = b_k.to(tl.float32) * b_beta[:, None]
        offs = (rows[:, None] * HV + i_h) * K + o_k[None, :]
        if PER_K:
            b_k = b_k * tl.exp(tl.load(G + offs, mask=mask, other=0.0))
        else:
            b_k = b_k * b_decay[:, None]
        tl.store(w + offs, tl.dot(b_Ai, b_k, input_precision=PREC), mask=mask)


def wy_transform(k, v, beta, G, Ai, layout: ChunkLayout, prec: str):
    """w [T_all, HV, K] and u [T_all, HV, V], fp32."""
    H, K = k.shape[1], k.shape[2]
    HV, V = v.shape[1], v.shape[2]
    w = torch.empty(v.shape[0], HV, K, dtype=torch.float32, device=v.device)
    u = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    wy_kernel[(layout.num_chunks, HV)](
        k, v, beta, G, Ai, w, u, layout.cu_seqlens, layout.chunk_indices,
        H=H, HV=HV, K=K, V=V, BT=layout.chunk_size, BK=key_block(K), BV=value_block(V),
        PER_K=G.ndim == 3, PREC=prec,
    )  # fmt: skip
    return w, u
