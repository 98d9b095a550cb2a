"""Argument checks shared by the delta-rule ops (GDN and KDA)."""

from __future__ import annotations

from itertools import pairwise

import torch

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHUNK_SIZES = (16, 32, 64)
L2NORM_EPS = 1e-6


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


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
        raise ValueError(f"q: expected [B,T,H,K], got shape {_shape(q)}")
    B, T, H, K = q.shape
    if _shape(k) != _shape(q):
        raise ValueError(f"k: expected shape {_shape(q)} like q, got {_shape(k)}")
    if v.ndim != 4 or _shape(v)[:2] != (B, T):
        raise ValueError(f"v: expected [B,T,HV,V] = ({B}, {T}, HV, V), got shape {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or K == 0 or V == 0 or HV % H != 0:
        raise ValueError(
            f"v: value heads HV={HV} must be a positive multiple of key heads H={H} "
            f"(q {_shape(q)}, v {_shape(v)})"
        )
    g_expected = (B, T, HV, K) if g_per_key else (B, T, HV)
    if _shape(g) != g_expected:
        raise ValueError(f"g: expected shape {g_expected}, got {_shape(g)}")
    if _shape(beta) != (B, T, HV):
        raise ValueError(f"beta: expected shape {(B, T, HV)}, got {_shape(beta)}")
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, t in named.items():
        if t.dtype not in INPUT_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} not in fp32/bf16/fp16 (shape {_shape(t)})")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
    if initial_state is not None:
        named["initial_state"] = initial_state
    if cu_seqlens is not None:
        named["cu_seqlens"] = cu_seqlens
    for name, t in named.items():
        if t.device != q.device:
            raise ValueError(f"{name}: on device {t.device}, but q is on {q.device}")

    n = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens: requires B == 1, got q of shape {_shape(q)}")
        if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens: expected [N+1] offsets, got shape {_shape(cu_seqlens)}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens: dtype {cu_seqlens.dtype} is not int32/int64")
        offsets = cu_seqlens.tolist()
        if offsets[0] != 0 or offsets[-1] != T or any(a > b for a, b in pairwise(offsets)):
            raise ValueError(
                f"cu_seqlens: expected non-decreasing offsets from 0 to T={T}, got {offsets}"
            )
        n = cu_seqlens.numel() - 1
    if initial_state is not None:
        if _shape(initial_state) != (n, HV, K, V):
            raise ValueError(
                f"initial_state: expected shape {(n, HV, K, V)} (N, HV, K, V), "
                f"got {_shape(initial_state)}"
            )
        if initial_state.dtype != torch.float32:
            raise ValueError(f"initial_state: dtype {initial_state.dtype} must be torch.float32")
    return n


def check_chunk_size(chunk_size: int) -> None:
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, got {chunk_size}")
