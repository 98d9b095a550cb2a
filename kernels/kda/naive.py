"""Torch fp32 references for Kimi Delta Attention: the token-by-token and the chunked forms.

KDA is the gated delta rule with one log-decay per key channel, g_t [K]:
    S <- diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t).
"""

from __future__ import annotations

import torch

from ..gdn.naive import chunk_per_sequence, prepare_inputs, spans, split_chunks, start_state


def naive_recurrent_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm=False, cu_seqlens=None,
):  # fmt: skip
    """Token-by-token KDA. Shapes as `kernels.kda.recurrent_kda`."""
    dtype = v.dtype
    q, k, v, g, beta = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm)
    B, T, HV, V = v.shape
    o = torch.zeros_like(v)
    finals = []
    for n, (b, bos, eos) in enumerate(spans(B, T, cu_seqlens)):
        S = start_state(initial_state, n, HV, k.shape[-1], V, v.device)
        for t in range(bos, eos):
            S = S * g[b, t].exp()[:, :, None]
            predicted = torch.einsum("hkv,hk->hv", S, k[b, t])
            delta = beta[b, t][:, None] * (v[b, t] - predicted)
            S = S + torch.einsum("hk,hv->hkv", k[b, t], delta)
            o[b, t] = torch.einsum("hkv,hk->hv", S, q[b, t])
        finals.append(S)
    return o.to(dtype), torch.stack(finals) if output_final_state else None


def _chunk_one(q, k, v, g, beta, S, chunk_size):
    """One sequence: q, k, g [L,HV,K], v [L,HV,V], beta [L,HV], S [HV,K,V] -> o [L,HV,V], S."""
    L = q.shape[0]
    q, k, v, g, beta = (split_chunks(t, chunk_size) for t in (q, k, v, g, beta))
    G = g.cumsum(-2)
    idx = torch.arange(chunk_size, device=q.device)
    causal = (idx[:, None] >= idx[None, :])[..., None]
    eye = torch.eye(chunk_size, device=q.device)
    o = torch.empty_like(v)
    for c in range(q.shape[1]):
        qc, kc, vc, Gc, bc = q[:, c], k[:, c], v[:, c], G[:, c], beta[:, c, :, None]
        # decay[h, i, j, c] = exp(G_ic - G_jc) for j <= i, else 0 (masked before exp: no overflow)
        diff = Gc[:, :, None, :] - Gc[:, None, :, :]
        decay = diff.masked_fill(~causal, float("-inf")).exp()
        A = (bc * torch.einsum("hic,hjc,hijc->hij", kc, kc, decay)).tril(-1)
        T_inv = torch.linalg.solve_triangular(eye + A, eye, upper=False)
        w = T_inv @ (bc * Gc.exp() * kc)
        u = T_inv @ (bc * vc)
        v_new = u - w @ S
        attn = torch.einsum("hic,hjc,hijc->hij", qc, kc, decay)
        o[:, c] = (qc * Gc.exp()) @ S + attn @ v_new
        g_last = Gc[:, -1]
        k_decayed = kc * (g_last[:, None] - Gc).exp()
        S = S * g_last.exp()[..., None] + k_decayed.transpose(-1, -2) @ v_new
    heads, V = o.shape[0], o.shape[-1]
    return o.movedim(0, 2).reshape(-1, heads, V)[:L], S


def naive_chunk_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm=False, chunk_size=64, cu_seqlens=None,
):  # fmt: skip
    """Chunked KDA (WY/UT transform inside chunks, state recurrence across). Shapes as chunk_kda."""
    return chunk_per_sequence(_chunk_one, q, k, v, g, beta, scale, initial_state,
                              output_final_state, use_qk_l2norm, chunk_size, cu_seqlens)  # fmt: skip
