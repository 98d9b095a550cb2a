"""Triton building blocks shared by the chunked GDN and KDA kernels: the chunk layout, l2norm,
chunk-local cumulative decay, the unit-lower-triangular inverse and the WY (w, u) transform.

Tensors are token-major and flattened over the batch: q, k [T_all, H, K], v [T_all, HV, V],
g/G [T_all, HV] (scalar decay) or [T_all, HV, K] (per-key decay), beta [T_all, HV], and the
chunk matrices A, Ai [T_all, HV, BT] (row t holds its chunk's row, columns 0..BT-1).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

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
    offsets = (
        cu_seqlens.tolist() if cu_seqlens is not None else [b * seqlen for b in range(batch + 1)]
    )
    counts = [triton.cdiv(eos - bos, chunk_size) for bos, eos in pairwise(offsets)]
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


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep exact fp32 products; half-precision inputs use tf32 tensor cores. Under
    the Triton interpreter tf32 is emulated, so its tests see the GPU's operand rounding."""
    if dtype == torch.float32:
        return "ieee"
    return "tf32_emulated" if triton.knobs.runtime.interpret else "tf32"


@triton.jit
def mma(a, b, PREC: tl.constexpr):
    """a @ b on fp32 tiles with fp32 accumulation, at the precision dot_precision chose."""
    if PREC == "tf32_emulated":
        # the tensor cores read the top 19 bits (tf32) of each fp32 operand
        a = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        b = (b.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def chunk_span(cu_seqlens, chunk_indices, i_t, BT: tl.constexpr):
    """First token of global chunk i_t and the end token of its sequence."""
    i_n = tl.load(chunk_indices + i_t * 2)
    i_c = tl.load(chunk_indices + i_t * 2 + 1)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    return bos + i_c * BT, eos


@triton.jit
def chunk_rows(cu_seqlens, chunk_indices, i_t, BT: tl.constexpr):
    """Row offsets 0..BT-1 of global chunk i_t, its token rows, and which rows hold tokens."""
    start, eos = chunk_span(cu_seqlens, chunk_indices, i_t, BT)
    o_t = tl.arange(0, BT)
    rows = start + o_t
    return o_t, rows, rows < eos


@triton.jit
def l2norm_kernel(
    x, y, n_rows, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, EPS: tl.constexpr
):
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
    """(I + a)^-1 for a strictly lower [16, 16] tile by forward substitution: step i sets row i
    to e_i - a_i t (a_i picks a's row i; t's rows from i on are still identity rows)."""
    o = tl.arange(0, 16)
    t = (o[:, None] == o[None, :]).to(tl.float32)
    for i in range(1, 16):
        t -= tl.dot(tl.where(o[:, None] == i, a, 0.0), t, input_precision="ieee")
    return t


@triton.jit
def solve_unit_lower_kernel(A, Ai, cu_seqlens, chunk_indices, HV: tl.constexpr, BT: tl.constexpr):
    """Ai = (I + A)^-1 per chunk: invert the 16x16 diagonal tiles, then merge the off-diagonal
    tiles with Ai_ij = -Ai_ii sum_{j<=m<i} A_im Ai_mj. Upper tiles of Ai are left unwritten.
    Tile (i, j) sits at offs + i * ROWS + j * 16; rows past the sequence end load as zeros."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    start, eos = chunk_span(cu_seqlens, chunk_indices, i_t, BT)
    o = tl.arange(0, 16)
    offs = ((start + o)[:, None] * HV + i_h) * BT + o[None, :]
    ROWS: tl.constexpr = 16 * HV * BT
    m0 = (start + o < eos)[:, None]
    t00 = _inverse_unit_lower_16(tl.load(A + offs, mask=m0, other=0.0))
    tl.store(Ai + offs, t00, mask=m0)
    if BT >= 32:
        m1 = (start + 16 + o < eos)[:, None]
        a10 = tl.load(A + offs + ROWS, mask=m1, other=0.0)
        t11 = _inverse_unit_lower_16(tl.load(A + offs + ROWS + 16, mask=m1, other=0.0))
        t10 = -tl.dot(tl.dot(t11, a10, input_precision="ieee"), t00, input_precision="ieee")
        tl.store(Ai + offs + ROWS, t10, mask=m1)
        tl.store(Ai + offs + ROWS + 16, t11, mask=m1)
    if BT >= 64:
        m2 = (start + 32 + o < eos)[:, None]
        m3 = (start + 48 + o < eos)[:, None]
        a20 = tl.load(A + offs + 2 * ROWS, mask=m2, other=0.0)
        a21 = tl.load(A + offs + 2 * ROWS + 16, mask=m2, other=0.0)
        t22 = _inverse_unit_lower_16(tl.load(A + offs + 2 * ROWS + 32, mask=m2, other=0.0))
        a30 = tl.load(A + offs + 3 * ROWS, mask=m3, other=0.0)
        a31 = tl.load(A + offs + 3 * ROWS + 16, mask=m3, other=0.0)
        a32 = tl.load(A + offs + 3 * ROWS + 32, mask=m3, other=0.0)
        t33 = _inverse_unit_lower_16(tl.load(A + offs + 3 * ROWS + 48, mask=m3, other=0.0))
        t21 = -tl.dot(tl.dot(t22, a21, input_precision="ieee"), t11, input_precision="ieee")
        t32 = -tl.dot(tl.dot(t33, a32, input_precision="ieee"), t22, input_precision="ieee")
        s20 = tl.dot(a20, t00, input_precision="ieee") + tl.dot(a21, t10, input_precision="ieee")
        t20 = -tl.dot(t22, s20, input_precision="ieee")
        s31 = tl.dot(a31, t11, input_precision="ieee") + tl.dot(a32, t21, input_precision="ieee")
        t31 = -tl.dot(t33, s31, input_precision="ieee")
        s30 = tl.dot(a30, t00, input_precision="ieee") + tl.dot(a31, t10, input_precision="ieee")
        s30 += tl.dot(a32, t20, input_precision="ieee")
        t30 = -tl.dot(t33, s30, input_precision="ieee")
        tl.store(Ai + offs + 2 * ROWS, t20, mask=m2)
        tl.store(Ai + offs + 2 * ROWS + 16, t21, mask=m2)
        tl.store(Ai + offs + 2 * ROWS + 32, t22, mask=m2)
        tl.store(Ai + offs + 3 * ROWS, t30, mask=m3)
        tl.store(Ai + offs + 3 * ROWS + 16, t31, mask=m3)
        tl.store(Ai + offs + 3 * ROWS + 32, t32, mask=m3)
        tl.store(Ai + offs + 3 * ROWS + 48, t33, mask=m3)


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
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PER_K: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """w = Ai (beta * exp(G) * k), u = Ai (beta * v) for one chunk and value head."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_kh = i_h // (HV // H)
    o_t, rows, m_t = chunk_rows(cu_seqlens, chunk_indices, i_t, BT)
    lower = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
    b_Ai = tl.load(Ai + (rows[:, None] * HV + i_h) * BT + o_t[None, :], mask=lower, other=0.0)
    b_beta = tl.load(beta + rows * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
    for i_v in range((V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        mask = m_t[:, None] & (o_v < V)[None, :]
        offs = (rows[:, None] * HV + i_h) * V + o_v[None, :]
        b_v = tl.load(v + offs, mask=mask, other=0.0).to(tl.float32) * b_beta[:, None]
        tl.store(u + offs, mma(b_Ai, b_v, PREC), mask=mask)
    if not PER_K:
        b_decay = tl.exp(tl.load(G + rows * HV + i_h, mask=m_t, other=0.0))
    for i_k in range((K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        mask = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + (rows[:, None] * H + i_kh) * K + o_k[None, :], mask=mask, other=0.0)
        b_k = b_k.to(tl.float32) * b_beta[:, None]
        offs = (rows[:, None] * HV + i_h) * K + o_k[None, :]
        if PER_K:
            b_k = b_k * tl.exp(tl.load(G + offs, mask=mask, other=0.0))
        else:
            b_k = b_k * b_decay[:, None]
        tl.store(w + offs, mma(b_Ai, b_k, PREC), mask=mask)


def wy_transform(k, v, beta, G, Ai, layout: ChunkLayout, prec: str):
    """w [T_all, HV, K] and u [T_all, HV, V], fp32."""
    H, K = k.shape[1], k.shape[2]
    HV, V = v.shape[1], v.shape[2]
    w = torch.empty(v.shape[0], HV, K, dtype=torch.float32, device=v.device)
    u = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    wy_kernel[(layout.num_chunks, HV)](
        k, v, beta, G, Ai, w, u, layout.cu_seqlens, layout.chunk_indices,
        H=H, HV=HV, K=K, V=V, BT=layout.chunk_size, BK=key_block(K), BV=value_block(V),
        PER_K=G.ndim == 3, PREC=prec, num_warps=8,
    )  # fmt: skip
    return w, u
