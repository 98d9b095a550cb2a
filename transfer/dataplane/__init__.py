"""Data plane: move byte ranges between registered arenas (NIXL, UCXX, or in-process).

It knows byte ranges and opaque metadata, nothing about models or layouts.
"""

from transfer.dataplane.factory import BACKENDS, DEFAULT_BACKEND, make_transport
from transfer.dataplane.ranges import RangeBatch
from transfer.dataplane.transport import Transport, wait
from transfer.dataplane.types import Notification, Op, State, TransferStatus

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "Notification",
    "Op",
    "RangeBatch",
    "State",
    "TransferStatus",
    "Transport",
    "make_transport",
    "wait",
]
