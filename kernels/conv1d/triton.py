"""Triton depthwise causal conv1d: prefill (batched or packed varlen) and the decode update."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16
BLOCK_D = 64


@triton.jit
def _conv_fwd_kernel(
    x,  # [total_T, D] contiguous
    weight,  # [D, W] contiguous
    bias,  # [D] or None
    initial_state,  # [N, D, W-1] any strides, or None
    y,  # [total_T, D] contiguous
    tiles,  # [num_tiles, 2] int64 (sequence, tile within it), varlen only
    cu_seqlens,  # [N+1] int64, varlen only
    seq_len,
    D,
    s_n,
    s_d,
    s_w,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_INITIAL: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    i_n = tl.program_id(2).to(tl.int64)
    if IS_VARLEN:
        i_n = tl.load(tiles + 2 * i_t)
        i_t = tl.load(tiles + 2 * i_t + 1)
        bos = tl.load(cu_seqlens + i_n)
        eos = tl.load(cu_seqlens + i_n + 1)
    else:
        bos = i_n * seq_len
        eos = bos + seq_len
    t = i_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)  # position within the sequence
    d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    d_mask = d < D
    row_mask = (bos + t) < eos

    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for w in tl.static_range(W):
        src = t - (W - 1) + w  # negative: the tap reaches into the state before the sequence
        in_seq = (src >= 0) & row_mask
        tap = tl.load(
            x + (bos + src)[:, None] * D + d[None, :],
            mask=in_seq[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_INITIAL:
            in_state = (src < 0) & row_mask
            tap += tl.load(
                initial_state + i_n * s_n + d[None, :] * s_d + (src + W - 1)[:, None] * s_w,
                mask=in_state[:, None] & d_mask[None, :],
                other=0.0,
            ).to(tl.float32)
        tap_weight = tl.load(weight + d * W + w, mask=d_mask, other=0.0).to(tl.float32)
        acc += tap * tap_weight[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(
        y + (bos + t)[:, None] * D + d[None, :],
        acc.to(y.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _conv_final_state_kernel(
    x,  # [total_T, D] contiguous
    initial_state,  # [N, D, W-1] any strides, or None
    final_state,  # [N, D, W-1] contiguous
    cu_seqlens,  # [N+1] int64, varlen only
    seq_len,
    D,
    s_n,
    s_d,
    s_w,
    W: tl.constexpr,
    HAS_INITIAL: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n)
        eos = tl.load(cu_seqlens + i_n + 1)
    else:
        bos = i_n * seq_len
        eos = bos + seq_len
    d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    j = tl.arange(0, BLOCK_W).to(tl.int64)
    src = eos - (W - 1) + j  # before bos: a short sequence keeps the tail of its initial state
    mask = (d < D)[:, None] & (j < W - 1)[None, :]
    value = tl.load(x + src[None, :] * D + d[:, None], mask=mask & (src >= bos)[None, :], other=0.0)
    if HAS_INITIAL:
        carried = tl.load(
            initial_state + i_n * s_n + d[:, None] * s_d + (src - bos + W - 1)[None, :] * s_w,
            mask=mask & (src < bos)[None, :],
            other=0.0,
        )
        value = tl.where((src < bos)[None, :], carried.to(value.dtype), value)
    tl.store(
        final_state + (i_n * D + d[:, None]) * (W - 1) + j[None, :],
        value.to(final_state.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _conv_update_kernel(
    x,  # [B, D] any strides
    conv_state,  # [B, D, W-1] any strides, updated in place
    weight,  # [D, W] contiguous
    bias,  # [D] or None
    y,  # [B, D] contiguous
    D,
    s_xb,
    s_xd,
    s_b,
    s_d,
    s_w,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)
    w = tl.arange(0, BLOCK_W).to(tl.int64)
    d_mask = d < D
    state_ptrs = conv_state + i_b * s_b + d[:, None] * s_d
    x_new = tl.load(x + i_b * s_xb + d * s_xd, mask=d_mask, other=0.0)

    # window[:, w] = state[:, w] for w < W-1, the new input at w = W-1
    window = tl.load(
        state_ptrs + w[None, :] * s_w, mask=d_mask[:, None] & (w[None, :] < W - 1), other=0.0
    )
    window = tl.where(w[None, :] == W - 1, x_new[:, None].to(window.dtype), window)
    # the same window shifted left by one is the next state; load it before any store
    shifted = tl.load(
        state_ptrs + (w[None, :] + 1) * s_w,
        mask=d_mask[:, None] & (w[None, :] + 1 < W - 1),
        other=0.0,
    )
    shifted = tl.where(w[None, :] == W - 2, x_new[:, None].to(shifted.dtype), shifted)

    taps = tl.load(
        weight + d[:, None] * W + w[None, :],
        mask=d_mask[:, None] & (w[None, :] < W),
        other=0.0,
    ).to(tl.float32)
    acc = tl.sum(window.to(tl.float32) * taps, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias + d, mask=d_mask, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + i_b * D + d, acc.to(y.dtype.element_ty), mask=d_mask)
    tl.store(state_ptrs + w[None, :] * s_w, shifted, mask=d_mask[:, None] & (w[None, :] < W - 1))


def _varlen_tiles(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[num_tiles, 2] (sequence, tile within the sequence) for every BLOCK_T tile."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    counts = (lengths + BLOCK_T - 1) // BLOCK_T
    sequence = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    tile = torch.arange(len(sequence), device=counts.device) - first
    return torch.stack([sequence, tile], dim=1).contiguous()


def causal_conv1d_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launcher for validated inputs; see `kernels.conv1d.causal_conv1d`."""
    batch, seq_len, dim = x.shape
    width = weight.shape[1]
    x, weight = x.contiguous(), weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    y = torch.empty_like(x)
    is_varlen = cu_seqlens is not None
    if is_varlen:
        cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.int64).contiguous()
        tiles = _varlen_tiles(cu_seqlens)
        num_seqs = len(cu_seqlens) - 1
        grid = (len(tiles), triton.cdiv(dim, BLOCK_D), 1)
    else:
        tiles = None
        num_seqs = batch
        grid = (triton.cdiv(seq_len, BLOCK_T), triton.cdiv(dim, BLOCK_D), batch)
    state_strides = initial_state.stride() if initial_state is not None else (0, 0, 0)
    if grid[0] > 0:
        _conv_fwd_kernel[grid](
            x, weight, bias, initial_state, y, tiles, cu_seqlens,
            seq_len, dim, *state_strides,
            W=width,
            SILU=activation == "silu",
            HAS_BIAS=bias is not None,
            HAS_INITIAL=initial_state is not None,
            IS_VARLEN=is_varlen,
            BLOCK_T=BLOCK_T,
            BLOCK_D=BLOCK_D,
        )  # fmt: skip
    if not output_final_state:
        return y, None
    final_state = x.new_empty(num_seqs, dim, width - 1)
    if num_seqs > 0:
        _conv_final_state_kernel[(num_seqs, triton.cdiv(dim, BLOCK_D))](
            x, initial_state, final_state, cu_seqlens,
            seq_len, dim, *state_strides,
            W=width,
            HAS_INITIAL=initial_state is not None,
            IS_VARLEN=is_varlen,
            BLOCK_W=triton.next_power_of_2(width - 1),
            BLOCK_D=BLOCK_D,
        )  # fmt: skip
    return y, final_state


def causal_conv1d_update_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
) -> torch.Tensor:
    """Launcher for validated inputs; see `kernels.conv1d.causal_conv1d_update`."""
    batch, dim = x.shape
    width = weight.shape[1]
    weight = weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    y = x.new_empty(batch, dim)
    if batch == 0:
        return y
    _conv_update_kernel[(batch, triton.cdiv(dim, BLOCK_D))](
        x, conv_state, weight, bias, y,
        dim, *x.stride(), *conv_state.stride(),
        W=width,
        SILU=activation == "silu",
        HAS_BIAS=bias is not None,
        BLOCK_W=triton.next_power_of_2(width),
        BLOCK_D=BLOCK_D,
    )  # fmt: skip
    return y
