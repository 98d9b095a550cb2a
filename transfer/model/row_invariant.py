"""Prefill steps whose rows do not depend on how many rows the step has, nor on where in
the step a row sits.

Two CPU kernels compute a value differently by its surroundings (torch's CPU build, one
thread, fp32; measured):
- A GEMM of fewer than 16 rows reduces in another order: the same row differs in its last
  bits between a 5-row and a 600-row pass (K 16-2,048 by N 16-4,096 tried, and odd
  shapes; never from 16 rows on). A one-column GEMM (a GEMV) differs at almost any row
  count.
- Sigmoid, SiLU and softplus run vectorized over the bulk of a contiguous tensor and
  through a scalar formula over its last few elements, which rounds differently; exp, log,
  tanh, sqrt and arithmetic do not.

A prefix-cache hit computes a few rows where a fresh prefill computed many, at other
offsets; an MoE expert gets a few rows or many. So that a hit leaves the caches of a fresh
prefill bit for bit, the model's layers call `linear`, `sigmoid`, `silu` and `softplus`
from here. Within `row_invariant(True)` (a step with prompt rows), `linear` runs over at
least `MIN_GEMM_ROWS` rows (zero rows added, their outputs dropped) and the activations
run over a copy padded to whole `VECTOR_BLOCK`s. Decode-only steps keep their natural
shapes: they have no such property to keep, and a batch of 4 padded to 16 rows would cost
decode throughput. GEMVs are left to the model (a one-column `linear` is written as a
row-wise sum there).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

MIN_GEMM_ROWS = 16
VECTOR_BLOCK = 64  # elements: a multiple of any CPU vector loop's step

_state = threading.local()


@contextlib.contextmanager
def row_invariant(enabled: bool) -> Iterator[None]:
    """Within (when enabled): `linear` and the activations here give each row what a pass
    of any length, at any offset, gives it."""
    previous = getattr(_state, "enabled", False)
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] (any leading dims without the row padding)."""
    rows = x.shape[0]
    if getattr(_state, "enabled", False) and x.dim() == 2 and 0 < rows < MIN_GEMM_ROWS:
        padded = torch.cat([x, x.new_zeros(MIN_GEMM_ROWS - rows, x.shape[1])])
        return (padded @ weight.T)[:rows]
    return x @ weight.T


def _elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    # A non-contiguous view runs row by row, every row alike; only a contiguous tensor's
    # single loop leaves a position-dependent tail.
    n = x.numel()
    if getattr(_state, "enabled", False) and x.is_contiguous() and n % VECTOR_BLOCK:
        flat = torch.cat([x.reshape(-1), x.new_zeros(VECTOR_BLOCK - n % VECTOR_BLOCK)])
        return fn(flat)[:n].view(x.shape)
    return fn(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _elementwise(torch.sigmoid, x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return _elementwise(F.silu, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return _elementwise(F.softplus, x)
