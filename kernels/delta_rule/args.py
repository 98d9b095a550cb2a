"""Argument checks of the delta-rule ops (GDN and KDA)."""

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

L2NORM_EPS = 1e-6


def check_delta_rule_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    g_per_key: bool,
) -> int:
    """Validate a delta-rule call; return N, the number of sequences (B, or len(cu_seqlens)-1).

    q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV] (or [B,T,HV,K] when g_per_key); beta [B,T,HV];
    initial_state [N,HV,K,V] fp32; cu_seqlens [N+1] int32/int64 with B == 1.
    """
    if q.ndim != 4:
        raise ValueError(f"q: expected [B,T,H,K], got shape {shape(q)}")
    B, T, H, K = q.shape
    if shape(k) != shape(q):
        raise ValueError(f"k: expected shape {shape(q)} like q, got {shape(k)}")
    if v.ndim != 4 or shape(v)[:2] != (B, T):
        raise ValueError(f"v: expected [B,T,HV,V] = ({B}, {T}, HV, V), got shape {shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or K == 0 or V == 0 or HV % H != 0:
        raise ValueError(
            f"v: value heads HV={HV} must be a positive multiple of key heads H={H} "
            f"(q {shape(q)}, v {shape(v)})"
        )
    g_expected = (B, T, HV, K) if g_per_key else (B, T, HV)
    if shape(g) != g_expected:
        raise ValueError(f"g: expected shape {g_expected}, got {shape(g)}")
    if shape(beta) != (B, T, HV):
        raise ValueError(f"beta: expected shape {(B, T, HV)}, got {shape(beta)}")
    check_input_dtypes({"q": q, "k": k, "v": v, "g": g, "beta": beta})
    check_same_dtype("q", q, {"k": k, "v": v})
    others = {"k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state}
    check_devices("q", q, others | {"cu_seqlens": cu_seqlens})
    n = num_sequences(cu_seqlens, "q", q)
    check_state(initial_state, (n, HV, K, V), "N, HV, K, V")
    return n
