"""pdxfer inside vLLM: `PdxferConnector` (vLLM loads it through `kv_connector_module_path`
"transfer.vllm") and the `Ticket` that travels in vLLM's `kv_transfer_params`.

The connector is imported on first use, so the ticket stays importable where vLLM is not."""

from typing import Any

from transfer.vllm.ticket import Ticket

__all__ = ["PdxferConnector", "Ticket"]


def __getattr__(name: str) -> Any:
    if name == "PdxferConnector":
        from transfer.vllm.connector import PdxferConnector

        return PdxferConnector
    raise AttributeError(f"module 'transfer.vllm' has no attribute {name!r}")
