"""Gated DeltaNet (one log-decay per head and token): chunked (prefill) and recurrent (decode)
ops, Triton or torch by backend."""

from __future__ import annotations

from ..delta_rule.ops import DeltaRuleKind, chunk_op, recurrent_op
from .naive import gdn_intra

__all__ = ["chunk_gdn", "recurrent_gdn"]

GDN = DeltaRuleKind("gdn", "gated delta rule", gdn_intra, decay_per_key=False)
chunk_gdn = chunk_op(GDN)
recurrent_gdn = recurrent_op(GDN)
