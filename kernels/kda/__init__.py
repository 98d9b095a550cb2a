"""Kimi Delta Attention (one log-decay per key channel): chunked (prefill) and recurrent
(decode) ops, Triton or torch by backend."""

from __future__ import annotations

from ..delta_rule.ops import DeltaRuleKind, chunk_op, recurrent_op
from .naive import kda_intra
from .subchunk import subchunk_kda_intra

__all__ = ["chunk_kda", "recurrent_kda"]

KDA = DeltaRuleKind(
    "kda", "Kimi Delta Attention", kda_intra, decay_per_key=True, torch_intra=subchunk_kda_intra
)
chunk_kda = chunk_op(KDA)
recurrent_kda = recurrent_op(KDA)
