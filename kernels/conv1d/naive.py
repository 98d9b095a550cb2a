"""Reference depthwise causal conv1d in fp32 torch, written for clarity."""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F


def causal_conv1d_naive(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [B,T,D], weight [D,W] -> y [B,T,D], final state [N,D,W-1] (the last W-1 inputs)."""
    if cu_seqlens is None:
        spans = [(b, 0, x.shape[1]) for b in range(x.shape[0])]
    else:
        bounds = cu_seqlens.tolist()
        spans = [(0, bos, eos) for bos, eos in pairwise(bounds)]
    width = weight.shape[1]
    y = torch.empty_like(x)
    final_states = []
    for n, (b, bos, eos) in enumerate(spans):
        seq = x[b, bos:eos].float().t()  # [D, L]
        if initial_state is None:
            history = seq.new_zeros(seq.shape[0], width - 1)
        else:
            history = initial_state[n].float()
        padded = torch.cat([history, seq], dim=1)  # [D, W-1+L]
        length = eos - bos
        out = sum(weight[:, w, None].float() * padded[:, w : w + length] for w in range(width))
        if bias is not None:
            out = out + bias.float()[:, None]
        if activation == "silu":
            out = F.silu(out)
        y[b, bos:eos] = out.t().to(x.dtype)
        final_states.append(padded[:, padded.shape[1] - (width - 1) :])
    if not output_final_state:
        return y, None
    return y, torch.stack(final_states).to(x.dtype)


def causal_conv1d_update_naive(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step: x [B,D]; conv_state [B,D,W-1] is shifted by one IN PLACE; y [B,D]."""
    state, x32, w = conv_state.float(), x.float(), weight.float()
    width = w.shape[1]
    # tap by tap over [B, D] rather than a reduction over a trailing dim of W elements
    out = x32 * w[:, width - 1]
    for tap in range(width - 1):
        out.addcmul_(state[:, :, tap], w[:, tap])
    if bias is not None:
        out = out + bias.float()
    if activation == "silu":
        out = F.silu(out)
    conv_state.copy_(torch.cat([state[:, :, 1:], x32[:, :, None]], dim=2))
    return out.to(x.dtype)
