"""Torch fp32 references for Gated DeltaNet: the delta rule with one log-decay per head and token.

    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t).

The recurrence and the chunk driver are shared with KDA (`kernels.delta_rule.naive`); a scalar
decay makes the intra-chunk decay one [C, C] matrix, so both chunk products are plain matmuls.
"""

from __future__ import annotations

from functools import partial

import torch

from ..delta_rule.naive import (
    causal_mask,
    exp_where,
    naive_chunk_delta_rule,
    naive_recurrent_delta_rule,
)


def gdn_intra(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor):
    """q, k [HV,C,K], G [HV,C,1] -> A_kk, A_qk [HV,C,C]: (x k^T) exp(G_i - G_j), j <= i."""
    G = G[..., 0]
    causal = causal_mask(G.shape[-1], G.device)
    decay = exp_where(G[..., :, None] - G[..., None, :], causal)
    return (k @ k.transpose(-1, -2)) * decay, (q @ k.transpose(-1, -2)) * decay


naive_recurrent_gdn = naive_recurrent_delta_rule
naive_chunk_gdn = partial(naive_chunk_delta_rule, gdn_intra)
