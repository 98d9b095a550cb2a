"""Argument checks of the Mamba2 ops."""

from __future__ import annotations

import torch

from ..scan_args import (
    check_devices,
    check_input_dtypes,
    check_same_dtype,
    check_state,
    num_sequences,
    shape,
)


def check_mamba2_args(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> int:
    """Validate a Mamba2 call; return N_seq, the number of sequences (B, or len(cu_seqlens)-1).

    x [B,T,H,P]; dt [B,T,H]; A [H]; B, C [B,T,G,N] with H a multiple of G; D [H] or None;
    initial_state [N_seq,H,P,N] fp32; cu_seqlens [N_seq+1] int32/int64 with B == 1.
    """
    if x.ndim != 4:
        raise ValueError(f"x: expected [B,T,H,P], got shape {shape(x)}")
    batch, T, H, P = x.shape
    if shape(dt) != (batch, T, H):
        raise ValueError(f"dt: expected shape {(batch, T, H)}, got {shape(dt)}")
    if B.ndim != 4 or shape(B)[:2] != (batch, T):
        raise ValueError(f"B: expected [B,T,G,N] = ({batch}, {T}, G, N), got shape {shape(B)}")
    G, N = B.shape[2], B.shape[3]
    if H == 0 or P == 0 or G == 0 or N == 0 or H % G != 0:
        raise ValueError(
            f"B: groups G={G} must divide heads H={H}, all positive (x {shape(x)}, B {shape(B)})"
        )
    if shape(C) != shape(B):
        raise ValueError(f"C: expected shape {shape(B)} like B, got {shape(C)}")
    for name, t in (("A", A), ("D", D)):
        if t is not None and shape(t) != (H,):
            raise ValueError(f"{name}: expected shape {(H,)}, got {shape(t)}")
    floats = {"x": x, "dt": dt, "A": A, "B": B, "C": C}
    check_input_dtypes(floats if D is None else floats | {"D": D})
    check_same_dtype("x", x, {"B": B, "C": C})
    others = {"dt": dt, "A": A, "B": B, "C": C, "D": D, "initial_state": initial_state}
    check_devices("x", x, others | {"cu_seqlens": cu_seqlens})
    n = num_sequences(cu_seqlens, "x", x)
    check_state(initial_state, (n, H, P, N), "N_seq, H, P, N")
    return n
