"""The public delta-rule ops, built once per kind: argument checks, then Triton or torch."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from ..backend import use_triton
from ..scan_args import check_chunk_size
from .args import check_delta_rule_args
from .naive import Intra, naive_chunk_delta_rule, naive_recurrent_delta_rule


@dataclass(frozen=True)
class DeltaRuleKind:
    """What a delta-rule variant brings of its own.

    name: "gdn" or "kda", the ops' suffix and package, whose `triton` module holds the Triton
    `chunk_intra` (imported only when Triton runs); title: what the ops' docstrings call it;
    naive_intra: the reference intra-chunk matrices (see `naive_chunk_delta_rule`);
    decay_per_key: g is [B,T,HV,K] rather than [B,T,HV]; torch_intra: the intra-chunk
    matrices the torch path (no Triton) runs with, where a kind has a faster exact form than
    its reference.
    """

    name: str
    title: str
    naive_intra: Intra
    decay_per_key: bool
    torch_intra: Intra | None = None


_CHUNK_DOC = """Chunked {title} over whole sequences (prefill).

    q, k [B,T,H,K]; v [B,T,HV,V] (value head j reads key head j // (HV//H)); g (log-decay, <= 0)
    {g_shape}; beta [B,T,HV]; initial_state [N,HV,K,V] fp32 where N is B, or len(cu_seqlens)-1
    when cu_seqlens packs N sequences into B=1. Returns o [B,T,HV,V] in v's dtype and, if
    output_final_state, the final state [N,HV,K,V] fp32 (else None). scale defaults to K**-0.5;
    chunk_size is 16, 32 or 64. use_qk_l2norm l2-normalises q and k (eps 1e-6) first.
    """

_RECURRENT_DOC = """Token-by-token {title} (decode). Shapes and results as `chunk_{name}`;
    state_in_place makes the final state land in initial_state, which is returned (needs
    initial_state and output_final_state). It spares no copy in general: the Triton kernel
    and the per-sequence loop compute the final state apart and copy it in; only the CPU
    decode step (one token per sequence) on a contiguous initial_state updates it where it
    is, without a fresh tensor."""


def _named(op, kind: DeltaRuleKind, form: str, doc: str):
    g_shape = "[B,T,HV,K]" if kind.decay_per_key else "[B,T,HV]"
    op.__name__ = op.__qualname__ = f"{form}_{kind.name}"
    op.__module__ = f"kernels.{kind.name}"
    op.__doc__ = doc.format(title=kind.title, name=kind.name, g_shape=g_shape)
    return op


def chunk_op(kind: DeltaRuleKind):
    """The chunked (prefill) op of one kind, e.g. `chunk_gdn`."""

    def op(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        scale: float | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm: bool = False,
        chunk_size: int = 64,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        check_delta_rule_args(q, k, v, g, beta, initial_state, cu_seqlens, kind.decay_per_key)
        check_chunk_size(chunk_size)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        args = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm)
        if use_triton(q, k, v, g, beta, initial_state):
            from .triton import triton_chunk_delta_rule

            intra = importlib.import_module(f"kernels.{kind.name}.triton").chunk_intra
            return triton_chunk_delta_rule(intra, *args, chunk_size, cu_seqlens)
        intra = kind.torch_intra or kind.naive_intra
        return naive_chunk_delta_rule(intra, *args, chunk_size=chunk_size, cu_seqlens=cu_seqlens)

    return _named(op, kind, "chunk", _CHUNK_DOC)


def recurrent_op(kind: DeltaRuleKind):
    """The token-by-token (decode) op of one kind, e.g. `recurrent_gdn`."""

    def op(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        scale: float | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        state_in_place: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        check_delta_rule_args(q, k, v, g, beta, initial_state, cu_seqlens, kind.decay_per_key)
        if state_in_place and (initial_state is None or not output_final_state):
            raise ValueError("state_in_place: needs an initial_state and output_final_state")
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        args = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm)
        if use_triton(q, k, v, g, beta, initial_state):
            from .triton_state import recurrent_delta_rule

            o, final = recurrent_delta_rule(*args, cu_seqlens)
            return o, initial_state.copy_(final) if state_in_place else final
        return naive_recurrent_delta_rule(
            *args, cu_seqlens=cu_seqlens, state_in_place=state_in_place
        )

    return _named(op, kind, "recurrent", _RECURRENT_DOC)
