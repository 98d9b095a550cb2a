"""Torch fp32 references for the gated delta rule, shared by GDN and KDA.

Per value head, with state S [K, V] and log-decay g_t, one value per key channel (KDA) or one
scalar broadcast over the channels (GDN):
    S <- diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t).

The chunked form differs between the kinds only in its intra-chunk matrices, so it takes an
`intra(q, k, G) -> (A_kk, A_qk)` function (see `naive_chunk_delta_rule`).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import torch

from ..rows import index_copy_rows_
from .args import L2NORM_EPS

Intra = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm):
    """fp32 copies: q, k repeated to the value heads, q scaled, g [B,T,HV,K] or [B,T,HV,1]."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    group = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = g if g.ndim == 4 else g[..., None]
    return q * scale, k, v, g, beta


def spans(batch: int, seqlen: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, first token, end token) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, seqlen) for b in range(batch)]
    return [(0, bos, eos) for bos, eos in pairwise(cu_seqlens.tolist())]


def start_state(initial_state, n, heads, K, V, device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(heads, K, V, dtype=torch.float32, device=device)
    return initial_state[n].float().clone()


def per_sequence(run_one, q, k, v, g, beta, scale, initial_state, output_final_state,
                 use_qk_l2norm, cu_seqlens):  # fmt: skip
    """Run `run_one(q, k, v, g, beta, S) -> (o, S)` over each sequence of the batch (or of
    `cu_seqlens`), on prepared inputs, threading initial and final states."""
    dtype = v.dtype
    q, k, v, g, beta = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm)
    B, T, HV, V = v.shape
    o = torch.zeros_like(v)
    finals = []
    for n, (b, bos, eos) in enumerate(spans(B, T, cu_seqlens)):
        S = start_state(initial_state, n, HV, k.shape[-1], V, v.device)
        if eos > bos:
            o[b, bos:eos], S = run_one(*(t[b, bos:eos] for t in (q, k, v, g, beta)), S)
        finals.append(S)
    return o.to(dtype), torch.stack(finals) if output_final_state else None


def _recurrent_one(q, k, v, g, beta, S):
    """One sequence token by token: q, k [L,HV,K], v [L,HV,V], g [L,HV,K|1], beta [L,HV]."""
    o = torch.empty_like(v)
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, :, None]
        predicted = torch.einsum("hkv,hk->hv", S, k[t])
        delta = beta[t][:, None] * (v[t] - predicted)
        S = S + torch.einsum("hk,hv->hkv", k[t], delta)
        o[t] = torch.einsum("hkv,hk->hv", S, q[t])
    return o, S


def _one_token_each(q, k, v, g, beta, S, out):
    """N sequences, one token each, at once: q, k [N,HV,K], v [N,HV,V], g [N,HV,K|1],
    beta [N,HV], entering states S [N,HV,K,V]; the leaving ones go to `out`, contiguous
    (S itself updates in place). The same update as `_recurrent_one`, batched over N, as
    (N*HV) small matrix products: on the CPU about 4x faster than the einsums, same bits.
    Returns o [N,HV,V]."""
    N, HV, K, V = S.shape
    flat = torch.mul(S, g.exp()[..., None], out=out).view(N * HV, K, V)
    predicted = torch.bmm(k.reshape(N * HV, 1, K), flat).view(N, HV, V)
    delta = beta[..., None] * (v - predicted)
    flat.baddbmm_(k.reshape(N * HV, K, 1), delta.reshape(N * HV, 1, V))
    return torch.bmm(q.reshape(N * HV, 1, K), flat).view(N, HV, V)


def _decode_step(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
                 state_in_place):  # fmt: skip
    """Every sequence of a varlen batch is one token ([1, N, ...] inputs): one batched update
    (a decode step) instead of a loop over sequences. In place, a contiguous initial_state
    (a private gather of the slots) is updated where it is, so the step fills no fresh
    tensor, its coldest write; a strided one (a view of a cache's slots) gets the result
    copied in."""
    dtype = v.dtype
    q, k, v, g, beta = (t[0] for t in prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm))
    N, HV, V = v.shape
    shape = (N, HV, k.shape[-1], V)
    if initial_state is None:
        S = out = torch.zeros(shape, dtype=torch.float32, device=v.device)
    else:
        S = initial_state
        in_place = state_in_place and S.is_contiguous()
        out = S if in_place else torch.empty(shape, dtype=torch.float32, device=v.device)
    o = _one_token_each(q, k, v, g, beta, S, out)
    if state_in_place and out is not initial_state:
        out = initial_state.copy_(out)
    return o[None].to(dtype), out if output_final_state else None


def naive_recurrent_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm=False, cu_seqlens=None, state_in_place=False,
):  # fmt: skip
    """Token-by-token delta rule; g [B,T,HV] (GDN) or [B,T,HV,K] (KDA). Shapes as recurrent_gdn."""
    one_token_each = cu_seqlens is not None and len(cu_seqlens) == v.shape[1] + 1
    if one_token_each and bool((cu_seqlens.diff() == 1).all()):
        return _decode_step(q, k, v, g, beta, scale, initial_state, output_final_state,
                            use_qk_l2norm, state_in_place)  # fmt: skip
    o, final = per_sequence(_recurrent_one, q, k, v, g, beta, scale, initial_state,
                            output_final_state, use_qk_l2norm, cu_seqlens)  # fmt: skip
    if state_in_place:
        final = initial_state.copy_(final)
    return o, final


def split_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[L, HV, ...] -> [HV, NC, C, ...], zero-padded to whole chunks."""
    pad = (-x.shape[0]) % chunk_size
    x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x
    x = x.reshape(-1, chunk_size, *x.shape[1:])
    return x.movedim(2, 0)


def causal_mask(chunk_size: int, device) -> torch.Tensor:
    """[C, C] bool, True where j <= i."""
    idx = torch.arange(chunk_size, device=device)
    return idx[:, None] >= idx[None, :]


def exp_where(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """exp(x) where `keep` (broadcast), exactly 0 elsewhere, never overflowing there. Not
    exp of -inf: the CPU's vectorized exp takes a slow path for it (about 15x slower)."""
    return torch.where(keep, x, 0.0).exp().mul_(keep)


def pack_chunks(lengths: list[int], chunk_size: int, device) -> tuple[torch.Tensor, list[int]]:
    """Every sequence cut into whole chunks: (source [M*C] int64, the packed token each chunk
    row reads, or -1 for the zero padding that ends a sequence's last chunk; first [N+1], the
    first chunk of each sequence, M = first[-1])."""
    first, rows, start = [0], [], 0
    for length in lengths:
        n = -(-length // chunk_size)
        rows.append(torch.arange(start, start + n * chunk_size, device=device))
        rows[-1][length:] = -1
        first.append(first[-1] + n)
        start += length
    source = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=device)
    return source, first


def gather_chunks(x: torch.Tensor, source: torch.Tensor | None, chunk_size: int) -> torch.Tensor:
    """x [T, HV, ...] -> [M, HV, C, ...] contiguous, by `source` (-1 reads zeros); None:
    every sequence is whole chunks, so x is already in chunk order."""
    if source is not None:
        padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
        x = padded[torch.where(source < 0, x.shape[0], source)]
    # one copy into head-major chunks, so that no later reshape or matmul copies again
    return x.view(-1, chunk_size, *x.shape[1:]).movedim(1, 2).contiguous()


def _chunked(intra: Intra, q, k, v, g, beta, lengths: list[int], S, chunk_size: int):
    """Packed sequences chunk by chunk (WY/UT form inside a chunk, state recurrence across):
    q, k [T,HV,K], v [T,HV,V], g [T,HV,K|1], beta [T,HV] hold the sequences of `lengths` back
    to back; S [N,HV,K,V] is their entering states. Everything that does not depend on S runs
    for every chunk of every sequence at once; only the recurrence steps chunk by chunk, over
    the sequences that have that chunk, so one sequence's bits never depend on the others."""
    source, first = pack_chunks(lengths, chunk_size, q.device)
    padded = any(length % chunk_size for length in lengths)
    rows = source if padded else None
    q, k, v, g = (gather_chunks(t, rows, chunk_size) for t in (q, k, v, g))
    b = gather_chunks(beta, rows, chunk_size)[..., None]  # [M, HV, C, 1]
    M, HV, C, K = k.shape
    G = g.cumsum(-2)
    eye = torch.eye(C, device=q.device)
    flat = (t.reshape(M * HV, C, -1) for t in (q, k, G))
    A_kk, A_qk = (a.view(M, HV, C, C) for a in intra(*flat))
    T_inv = torch.linalg.solve_triangular(eye + (b * A_kk).tril(-1), eye, upper=False)
    w = T_inv @ (b * G.exp() * k)
    u = T_inv @ (b * v)
    q_decayed = q * G.exp()
    g_last = G[:, :, -1:]
    k_decayed = k * (g_last - G).exp()
    state_decay = g_last.transpose(-1, -2).exp()
    o = torch.empty_like(v)
    counts = [first[n + 1] - first[n] for n in range(len(lengths))]
    for c in range(max(counts, default=0)):
        members = [n for n, count in enumerate(counts) if count > c]
        ids = torch.tensor([first[n] + c for n in members], device=q.device)
        seq = torch.tensor(members, device=q.device)
        S_c = S.index_select(0, seq)
        u_c, w_c, q_c, a_c, decay_c, k_c = (
            t.index_select(0, ids) for t in (u, w, q_decayed, A_qk, state_decay, k_decayed)
        )
        v_new = u_c - w_c @ S_c
        index_copy_rows_(o, ids, q_c @ S_c + a_c @ v_new)
        index_copy_rows_(S, seq, S_c * decay_c + k_c.transpose(-1, -2) @ v_new)
    out = o.movedim(2, 1).reshape(M * C, HV, -1)
    return (out[source >= 0] if padded else out), S


def naive_chunk_delta_rule(
    intra: Intra, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm=False, chunk_size=64, cu_seqlens=None,
):  # fmt: skip
    """Chunked delta rule. intra(q, k, G) gets chunks' q, k [M,C,K] and cumulative log-decay
    G [M,C,K|1] and returns A_kk and A_qk [M,C,C], sum_c x_ic k_jc exp(G_ic - G_jc) for
    j <= i (x = k, then q), zero above the diagonal. Other shapes as chunk_gdn."""
    dtype = v.dtype
    q, k, v, g, beta = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm)
    B, T, HV, V = v.shape
    bounds = spans(B, T, cu_seqlens)
    lengths = [eos - bos for _, bos, eos in bounds]
    if initial_state is None:
        S = torch.zeros(len(bounds), HV, k.shape[-1], V, dtype=torch.float32, device=v.device)
    else:
        S = initial_state.float().clone()
    # cu_seqlens spans 0..T, so either form is the sequences back to back along B*T tokens
    flat = (t.reshape(B * T, *t.shape[2:]) for t in (q, k, v, g, beta))
    o, S = _chunked(intra, *flat, lengths, S, chunk_size)
    return o.view(B, T, HV, V).to(dtype), S if output_final_state else None
