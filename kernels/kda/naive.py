"""Torch fp32 references for Kimi Delta Attention: the delta rule with one log-decay per key
channel, g_t [K]:

    S <- diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t).

The recurrence and the chunk driver are shared with GDN (`kernels.delta_rule.naive`); here the
intra-chunk decay differs per channel, so it sits inside the sum over channels.
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


def kda_intra(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor):
    """q, k, G [HV,C,K] -> A_kk, A_qk [HV,C,C]: sum_c x_ic k_jc exp(G_ic - G_jc), j <= i."""
    causal = causal_mask(G.shape[1], G.device)[..., None]
    decay = exp_where(G[:, :, None, :] - G[:, None, :, :], causal)
    A_kk = torch.einsum("hic,hjc,hijc->hij", k, k, decay)
    return A_kk, torch.einsum("hic,hjc,hijc->hij", q, k, decay)


naive_recurrent_kda = naive_recurrent_delta_rule
naive_chunk_kda = partial(naive_chunk_delta_rule, kda_intra)
