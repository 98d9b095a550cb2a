"""The engine-agnostic transfer agent: registration, posting a plan's reads, polling, and
the settle check. It knows no model and no engine (`transfer.agent.agent`)."""

from transfer.agent.agent import Finished, PeerReads, TransferAgent, plan_reads

__all__ = ["Finished", "PeerReads", "TransferAgent", "plan_reads"]
