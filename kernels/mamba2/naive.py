"""Torch fp32 references for the Mamba2 (SSD) scan: the token-by-token and the chunked forms.

Per head h, with state S [P, N], x_t [P], dt_t and A scalars, B_t, C_t [N] of the head's group:
    S <- exp(dt_t A) S + dt_t x_t B_t^T;  y_t = S C_t + D x_t.

The chunked form is the one transformers' Nemotron-H torch fallback computes: inside a chunk,
y_i = sum_{j<=i} (C_i . B_j) exp(a_{j+1} + ... + a_i) dt_j x_j with a = dt A (segment sums),
plus exp(a_1 + ... + a_i) S_chunk C_i from the state entering the chunk.
"""

from __future__ import annotations

import torch

from ..delta_rule.naive import causal_mask, exp_where, spans, split_chunks, start_state


def prepare_inputs(x, dt, A, B, C, D):
    """fp32 copies, B and C repeated from their groups to the heads, D zeros when None."""
    x, dt, A, B, C = (t.float() for t in (x, dt, A, B, C))
    heads_per_group = x.shape[2] // B.shape[2]
    B = B.repeat_interleave(heads_per_group, dim=2)
    C = C.repeat_interleave(heads_per_group, dim=2)
    D = torch.zeros_like(A) if D is None else D.float()
    return x, dt, A, B, C, D


def over_sequences(run_one, x, dt, A, B, C, D, initial_state, output_final_state, cu_seqlens):
    """Run `run_one(x, dt, B, C, A, D, S) -> (y, S)` on each sequence, threading the states."""
    dtype = x.dtype
    x, dt, A, B, C, D = prepare_inputs(x, dt, A, B, C, D)
    batch, T, H, P = x.shape
    y = torch.zeros_like(x)
    finals = []
    for n, (b, bos, eos) in enumerate(spans(batch, T, cu_seqlens)):
        S = start_state(initial_state, n, H, P, B.shape[-1], x.device)
        if eos > bos:
            y[b, bos:eos], S = run_one(*(t[b, bos:eos] for t in (x, dt, B, C)), A, D, S)
        finals.append(S)
    return y.to(dtype), torch.stack(finals) if output_final_state else None


def _recurrent_one(x, dt, B, C, A, D, S):
    """x [L,H,P], dt [L,H], B, C [L,H,N], A, D [H], S [H,P,N]."""
    y = torch.empty_like(x)
    for t in range(x.shape[0]):
        dA = torch.exp(dt[t] * A)
        S = S * dA[:, None, None] + (dt[t, :, None] * x[t])[:, :, None] * B[t, :, None, :]
        y[t] = torch.einsum("hpn,hn->hp", S, C[t]) + D[:, None] * x[t]
    return y, S


def naive_recurrent_mamba2(
    x, dt, A, B, C, D=None, initial_state=None, output_final_state=False, cu_seqlens=None
):
    """Token-by-token Mamba2. Shapes as `kernels.mamba2.recurrent_mamba2`."""
    return over_sequences(
        _recurrent_one, x, dt, A, B, C, D, initial_state, output_final_state, cu_seqlens
    )


def segment_decays(a: torch.Tensor) -> torch.Tensor:
    """a [..., C] -> [..., C, C]: out[i, j] = exp(a_{j+1} + ... + a_i) for j <= i, 0 above.

    Summed directly rather than as a difference of cumulative sums, which loses precision."""
    size = a.shape[-1]
    idx = torch.arange(size, device=a.device)
    terms = a[..., :, None].expand(*a.shape, size)  # terms[..., k, j] = a_k
    terms = terms.masked_fill(idx[:, None] <= idx[None, :], 0.0)  # keep k > j
    sums = terms.cumsum(-2)  # sums[..., i, j] = sum over j < k <= i
    return exp_where(sums, causal_mask(size, a.device))


def _chunk_one(x, dt, B, C, A, D, S, chunk_size: int):
    """One sequence chunk by chunk; shapes as `_recurrent_one`."""
    L = x.shape[0]
    skip = D[:, None] * x
    x_dt = x * dt[..., None]
    a = dt * A
    x_dt, a, B, C = (split_chunks(t, chunk_size) for t in (x_dt, a, B, C))  # [H, NC, C, ...]
    a_cum = a.cumsum(-1)
    y = torch.empty_like(x_dt)
    for c in range(x_dt.shape[1]):
        xc, Bc, Cc, ac = x_dt[:, c], B[:, c], C[:, c], a_cum[:, c]
        mixing = (Cc @ Bc.transpose(-1, -2)) * segment_decays(a[:, c])
        y[:, c] = mixing @ xc + ac.exp()[..., None] * (Cc @ S.transpose(-1, -2))
        to_end = (ac[:, -1:] - ac).exp()[..., None]
        S = S * ac[:, -1].exp()[:, None, None] + (xc * to_end).transpose(-1, -2) @ Bc
    heads, P = y.shape[0], y.shape[-1]
    return y.movedim(0, 2).reshape(-1, heads, P)[:L] + skip, S


def naive_chunk_mamba2(
    x, dt, A, B, C, D=None, initial_state=None, output_final_state=False, chunk_size=64,
    cu_seqlens=None,
):  # fmt: skip
    """Chunked Mamba2 (SSD). Shapes as `kernels.mamba2.chunk_mamba2`."""

    def run_one(x, dt, B, C, A, D, S):
        return _chunk_one(x, dt, B, C, A, D, S, chunk_size)

    return over_sequences(run_one, x, dt, A, B, C, D, initial_state, output_final_state,
                          cu_seqlens)  # fmt: skip
