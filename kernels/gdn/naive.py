"""Torch fp32 references for Gated DeltaNet: the token-by-token and the chunked (WY/UT) forms.

Per value head, with state S [K, V] and scalar log-decay g_t:
    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t).
"""

from __future__ import annotations

from itertools import pairwise

import torch

from .args import L2NORM_EPS


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm):
    """fp32 copies with q, k repeated to the value heads and q scaled."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    group = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta


def spans(batch: int, seqlen: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, first token, end token) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, seqlen) for b in range(batch)]
    offsets = cu_seqlens.tolist()
    return [(0, bos, eos) for bos, eos in pairwise(offsets)]


def start_state(initial_state, n, heads, K, V, device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(heads, K, V, dtype=torch.float32, device=device)
    return initial_state[n].float().clone()


def naive_recurrent_gdn(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm=False, cu_seqlens=None,
):  # fmt: skip
    """Token-by-token GDN. Shapes as `kernels.gdn.recurrent_gdn`."""
    dtype = v.dtype
    q, k, v, g, beta = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm)
    B, T, HV, V = v.shape
    o = torch.zeros_like(v)
    finals = []
    for n, (b, bos, eos) in enumerate(spans(B, T, cu_seqlens)):
        S = start_state(initial_state, n, HV, k.shape[-1], V, v.device)
        for t in range(bos, eos):
            S = S * g[b, t].exp()[:, None, None]
            predicted = torch.einsum("hkv,hk->hv", S, k[b, t])
            delta = beta[b, t][:, None] * (v[b, t] - predicted)
            S = S + torch.einsum("hk,hv->hkv", k[b, t], delta)
            o[b, t] = torch.einsum("hkv,hk->hv", S, q[b, t])
        finals.append(S)
    return o.to(dtype), torch.stack(finals) if output_final_state else None


def split_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[L, HV, ...] -> [HV, NC, C, ...], zero-padded to whole chunks."""
    pad = (-x.shape[0]) % chunk_size
    x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x
    x = x.reshape(-1, chunk_size, *x.shape[1:])
    return x.movedim(2, 0)


def _chunk_one(q, k, v, g, beta, S, chunk_size):
    """One sequence: q, k [L,HV,K], v [L,HV,V], g, beta [L,HV], S [HV,K,V] -> o [L,HV,V], S."""
    L = q.shape[0]
    q, k, v, g, beta = (split_chunks(t, chunk_size) for t in (q, k, v, g, beta))
    G = g.cumsum(-1)
    idx = torch.arange(chunk_size, device=q.device)
    causal = idx[:, None] >= idx[None, :]
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(chunk_size, device=q.device)
    T_inv = torch.linalg.solve_triangular(eye + A, eye, upper=False)
    w = T_inv @ (beta[..., None] * G.exp()[..., None] * k)
    u = T_inv @ (beta[..., None] * v)
    attn = q @ k.transpose(-1, -2) * decay
    o = torch.empty_like(v)
    for c in range(q.shape[1]):
        v_new = u[:, c] - w[:, c] @ S
        o[:, c] = (q[:, c] * G[:, c].exp()[..., None]) @ S + attn[:, c] @ v_new
        g_last = G[:, c, -1]
        k_decayed = k[:, c] * (g_last[:, None] - G[:, c]).exp()[..., None]
        S = S * g_last.exp()[:, None, None] + k_decayed.transpose(-1, -2) @ v_new
    heads, V = o.shape[0], o.shape[-1]
    return o.movedim(0, 2).reshape(-1, heads, V)[:L], S


def chunk_per_sequence(chunk_one, q, k, v, g, beta, scale, initial_state, output_final_state,
                       use_qk_l2norm, chunk_size, cu_seqlens):  # fmt: skip
    """Run `chunk_one(q, k, v, g, beta, S, chunk_size) -> (o, S)` over each sequence of the
    batch (or of `cu_seqlens`), threading initial and final states. Shared by GDN and KDA."""
    dtype = v.dtype
    q, k, v, g, beta = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm)
    B, T, HV, V = v.shape
    o = torch.zeros_like(v)
    finals = []
    for n, (b, bos, eos) in enumerate(spans(B, T, cu_seqlens)):
        S = start_state(initial_state, n, HV, k.shape[-1], V, v.device)
        if eos > bos:
            part = (t[b, bos:eos] for t in (q, k, v, g, beta))
            o[b, bos:eos], S = chunk_one(*part, S, chunk_size)
        finals.append(S)
    return o.to(dtype), torch.stack(finals) if output_final_state else None


def naive_chunk_gdn(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm=False, chunk_size=64, cu_seqlens=None,
):  # fmt: skip
    """Chunked GDN (WY/UT transform inside chunks, state recurrence across). Shapes as chunk_gdn."""
    return chunk_per_sequence(_chunk_one, q, k, v, g, beta, scale, initial_state,
                              output_final_state, use_qk_l2norm, chunk_size, cu_seqlens)  # fmt: skip
