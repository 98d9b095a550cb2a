"""The engine-agnostic transfer agent: registration, posting a plan's reads, polling, and
the settle check. It knows no model and no engine (`transfer.agent.agent`)."""

from transfer.agent.agent import Finished, PeerReads, TransferAgent, plan_reads
from transfer.agent.staging import StagedReads, stage_small

__all__ = ["Finished", "PeerReads", "StagedReads", "TransferAgent", "plan_reads", "stage_small"]
