"""KDA's intra-chunk matrices in torch, cut into sub-chunks as the Triton kernel cuts them: what
the torch path (CPUs) computes with. `naive.kda_intra` forms exp(G_i - G_j) for every pair and
channel of a chunk, C*C*K exps per chunk; here only a diagonal sub-chunk does that, and an
off-diagonal pair of sub-chunks factors its decay through the first row r of the later one,
exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j), both arguments <= 0 (g <= 0), into one matmul.
"""

from __future__ import annotations

import torch

from ..delta_rule.naive import causal_mask, exp_where

# Rows of a sub-chunk: the diagonal blocks cost C*S*K exps and the factored part about C*C*K/S
# multiply-adds over masked columns. On one CPU thread, K = 32, median of 7: 512 chunks of 16
# rows took 6.5 ms at 4, 8.7 ms at 8 and 18 ms at 16 (the reference: 17 ms); 256 chunks of 32
# rows, 10 ms at 4 or 8 and 28 ms at 16 (the reference: 108 ms).
SUB_CHUNK = 4


def subchunk_kda_intra(
    q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, sub_chunk: int = SUB_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, G [N,C,K] -> A_kk, A_qk [N,C,C]: sum_c x_ic k_jc exp(G_ic - G_jc) for j <= i
    (x = k, then q), zero above the diagonal; `naive.kda_intra`'s values in another order.
    G is each chunk's cumulative log-decay, non-increasing along C."""
    N, C, K = k.shape
    S = min(sub_chunk, C)
    if C % S:
        raise ValueError(f"sub_chunk: {sub_chunk} does not divide the chunk size {C}")
    n = C // S
    blocks = (N, n, S, K)
    A_kk = k.new_zeros(N, n, S, n, S)
    A_qk = torch.zeros_like(A_kk)
    Gb, kb, qb = G.reshape(blocks), k.reshape(blocks), q.reshape(blocks)
    if n > 1:
        _off_diagonal(qb, kb, Gb, A_kk, A_qk)
    # a diagonal block: every pair (a, b <= a) gets its own decay, masked before exp
    causal = causal_mask(S, G.device)[..., None]
    k_decayed = kb[:, :, None] * exp_where(Gb[:, :, :, None] - Gb[:, :, None], causal)
    diagonal = torch.arange(n, device=G.device)
    for A, x in ((A_kk, kb), (A_qk, qb)):
        # [N,n,S,1,K] @ [N,n,S,K,S] -> [N,n,S,S]; advanced indices put the block axis first
        block = (x[..., None, :] @ k_decayed.transpose(-1, -2))[..., 0, :]
        A[:, diagonal, :, diagonal] = block.transpose(0, 1)
    return A_kk.view(N, C, C), A_qk.view(N, C, C)


def _off_diagonal(qb, kb, Gb, A_kk, A_qk) -> None:
    """Sub-chunk rows 1..n-1 against every earlier sub-chunk, in one batched matmul each."""
    N, n, S, K = kb.shape
    first = Gb[:, 1:, :1]  # [N,n-1,1,K]: G at the first row r of each later sub-chunk
    within = (Gb[:, 1:] - first).exp()  # exp(G_i - G_r), i >= r
    earlier = (n - 1) * S  # the columns any later sub-chunk reads
    G_cols = Gb[:, : n - 1].reshape(N, 1, earlier, K)
    # exp(G_r - G_j) for j < r, zero for the columns at or past r (their exponent is > 0)
    rows = torch.arange(1, n, device=Gb.device)[:, None] * S
    before = (torch.arange(earlier, device=Gb.device)[None, :] < rows)[..., None]
    k_cols = kb[:, : n - 1].reshape(N, 1, earlier, K) * exp_where(first - G_cols, before)
    k_cols = k_cols.transpose(-1, -2)  # [N,n-1,K,earlier]
    for A, x in ((A_kk, kb), (A_qk, qb)):
        A[:, 1:, :, : n - 1] = ((x[:, 1:] * within) @ k_cols).view(N, n - 1, S, n - 1, S)
