"""The packer: which byte ranges each decode rank reads from which prefill rank.

It works only on layouts and ids, never on tensors (docs/packer.md).
"""

from transfer.packer.build import (
    StagingPolicy,
    coalesce,
    naive_descriptors,
    plan_transfer,
    prefill_gathers,
    staging_extents,
)
from transfer.packer.copies import source_rank
from transfer.packer.plan import Mode, Ranges, SourcePlan, StagingWindow, TransferPlan
from transfer.packer.request import TransferRequest, validate

__all__ = [
    "Mode",
    "Ranges",
    "SourcePlan",
    "StagingPolicy",
    "StagingWindow",
    "TransferPlan",
    "TransferRequest",
    "coalesce",
    "naive_descriptors",
    "plan_transfer",
    "prefill_gathers",
    "source_rank",
    "staging_extents",
    "validate",
]
