"""Control plane: the request lifecycle between router, prefill and decode instances (docs/control.md).

This package knows block ids, slot ids, counts and opaque bytes, nothing of
layouts or transports. The gRPC side lives in `server`, `client` and
`convert` (the only modules that import the generated `gen` code); import them
directly. This module stays importable without `gen`, so `codegen` can rebuild it.
"""

from transfer.control.errors import CompatMismatch, ControlError, TicketStateError, UnknownRequest
from transfer.control.metrics import MetricsServer, WorkerMetrics, serve_metrics
from transfer.control.tickets import TicketStore
from transfer.control.types import (
    COMPAT_FIELDS,
    WIRE_VERSION,
    ControlConfig,
    DecodeRequest,
    FreeReason,
    GenerateRequest,
    HandshakeReply,
    HandshakeRequest,
    PrefillRequest,
    Ticket,
    TokenEvent,
    compat_hash,
    make_compat,
)

__all__ = [
    "COMPAT_FIELDS",
    "WIRE_VERSION",
    "CompatMismatch",
    "ControlConfig",
    "ControlError",
    "DecodeRequest",
    "FreeReason",
    "GenerateRequest",
    "HandshakeReply",
    "HandshakeRequest",
    "MetricsServer",
    "PrefillRequest",
    "Ticket",
    "TicketStateError",
    "TicketStore",
    "TokenEvent",
    "UnknownRequest",
    "WorkerMetrics",
    "compat_hash",
    "make_compat",
    "serve_metrics",
]
