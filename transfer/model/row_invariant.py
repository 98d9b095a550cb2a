"""Prefill steps whose rows do not depend on how many rows the step has, nor on where in
the step a row sits.

Two CPU kernels compute a value differently by its surroundings (torch's CPU build, one
thread, fp32; measured):
- A GEMM of fewer than 16 rows reduces in another order: the same row differs in its last
  bits between a 5-row and a 600-row pass (every shape from 16 to 4,096 tried; never from
  16 rows on). A one-column GEMM (a GEMV) differs at almost any row count.
- Sigmoid, SiLU, softplus and GELU run vectorized over the bulk of a tensor and through a
  scalar formula over its last few elements, which rounds differently; exp, log, tanh,
  sqrt and arithmetic do not.

A prefix-cache hit computes a few rows where a fresh prefill computed many, at other
offsets; an MoE expert gets a few rows or many. So that a hit leaves the caches of a fresh
prefill bit for bit, within `row_invariant(True)` every 2-D GEMM runs over at least
`MIN_GEMM_ROWS` rows (zero rows added, their outputs dropped), and those activations run
over a contiguous copy padded to whole `VECTOR_BLOCK`s. Prefill steps enable it;
decode-only steps keep their natural shapes (they have no such property to keep, and a
batch of 4 padded to 16 rows would cost decode throughput). GEMVs are left to the model
(`x @ w` with one output column is written as a row-wise sum there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MIN_GEMM_ROWS = 16
VECTOR_BLOCK = 64  # elements: a multiple of any CPU vector loop's step

_GEMMS = frozenset(
    {torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.__matmul__,
     F.linear}
)  # fmt: skip
_TAIL_SENSITIVE = frozenset({torch.sigmoid, torch.Tensor.sigmoid, F.silu, F.softplus, F.gelu})


class _Invariant(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return func(*args, **kwargs)
        if func in _GEMMS and x.dim() == 2 and 0 < x.shape[0] < MIN_GEMM_ROWS:
            padded = torch.cat([x, x.new_zeros(MIN_GEMM_ROWS - x.shape[0], x.shape[1])])
            return func(padded, *args[1:], **kwargs)[: x.shape[0]]
        if func in _TAIL_SENSITIVE and not kwargs.get("inplace", False) and x.numel():
            n = x.numel()
            flat = torch.cat([x.reshape(-1), x.new_zeros((-n) % VECTOR_BLOCK)])
            return func(flat, *args[1:], **kwargs)[:n].view(x.shape)
        return func(*args, **kwargs)


@contextlib.contextmanager
def row_invariant(enabled: bool) -> Iterator[None]:
    """Within (when enabled): a row's GEMM outputs and activations come out as they would in
    a pass of any length, at any offset."""
    if not enabled:
        yield
        return
    with _Invariant():
        yield
