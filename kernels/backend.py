"""Backend choice for every public op: Triton on CUDA (or when forced), torch otherwise."""

from __future__ import annotations

import os

import torch

ENV_VAR = "PDXFER_KERNEL_BACKEND"
BACKENDS = ("torch", "triton")


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """True when the Triton kernel should run for these inputs.

    `PDXFER_KERNEL_BACKEND=triton|torch` forces a backend; with `TRITON_INTERPRET=1`
    the Triton kernels run on the CPU. Otherwise Triton runs when the inputs are on CUDA.
    """
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced and forced not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={forced!r}: expected one of {', '.join(BACKENDS)}")
    if forced:
        return forced == "triton"
    return any(t is not None and t.is_cuda for t in tensors)
