"""Worker processes: prefill and decode instances (control process + TP rank processes),
the router's serve loop, and the local launcher's process handling (docs/workers.md)."""
