"""pdxfer inside vLLM. So far only the ticket that travels in vLLM's `kv_transfer_params`
(`Ticket`); the `PdxferConnector` class itself is not written yet."""

from transfer.vllm.ticket import Ticket

__all__ = ["Ticket"]
