"""Depthwise causal conv1d in fp32 torch: the CPU path and the Triton kernels' reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rows import index_copy_rows_

# Rows of the padded output buffer start on this many elements: each row of a strided
# view then runs the same vector loop, so no output's bits depend on the other sequences
# (a contiguous tensor's loop ends in a scalar tail that rounds SiLU differently).
ROW_ALIGN = 64


def causal_conv1d_naive(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [B,T,D], weight [D,W] -> y [B,T,D], final state [N,D,W-1] (the last W-1 inputs).

    Every sequence goes time-major into one buffer behind its W-1 entering inputs, the
    sequences back to back; y is then W shifted multiply-adds over the whole buffer, read
    at the rows of real tokens."""
    batch, seq_len, dim = x.shape
    history = weight.shape[1] - 1
    if cu_seqlens is None:
        lengths = torch.full((batch,), seq_len, dtype=torch.long, device=x.device)
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    num_seqs, num_tokens = len(lengths), batch * seq_len
    # sequence n's entering inputs sit at rows ends[n] - L_n - W+1 .. ends[n] - L_n
    ends = (lengths + history).cumsum(0)
    sequence = torch.repeat_interleave(torch.arange(num_seqs, device=x.device), lengths)
    token_rows = torch.arange(num_tokens, device=x.device) + (sequence + 1) * history
    history_rows = (ends - lengths)[:, None] - history + torch.arange(history, device=x.device)
    padded = x.new_empty(num_tokens + num_seqs * history, dim, dtype=torch.float32)
    index_copy_rows_(padded, token_rows, x.reshape(num_tokens, dim))
    if initial_state is None:
        entering = padded.new_zeros(num_seqs * history, dim)
    else:
        entering = initial_state.float().transpose(1, 2).reshape(-1, dim)
    index_copy_rows_(padded, history_rows.flatten(), entering)
    rows = padded.shape[0] - history
    out = padded.new_empty(rows, -(-dim // ROW_ALIGN) * ROW_ALIGN)[:, :dim]
    taps = weight.float().t().contiguous()  # [W, D]: each tap's weights contiguous
    torch.mul(taps[0], padded[:rows], out=out)
    for tap in range(1, history + 1):
        out.add_(taps[tap] * padded[tap : tap + rows])
    if bias is not None:
        out.add_(bias.float())
    if activation == "silu":
        F.silu(out, inplace=True)
    y = out.index_select(0, token_rows - history).to(x.dtype).view(batch, seq_len, dim)
    if not output_final_state:
        return y, None
    last = ends[:, None] - history + torch.arange(history, device=x.device)
    final = padded.index_select(0, last.flatten()).view(num_seqs, history, dim)
    return y, final.transpose(1, 2).to(x.dtype)


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
