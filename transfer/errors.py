"""pdxfer's errors, by kind. Every layer raises these; only the gRPC server boundary
(`transfer.control.errors.status_code_name`) turns a kind into a status code.

The kinds also subclass the matching builtin (`InvalidInput` is a `ValueError`, ...), so
callers that catch the builtin keep working.
"""

from __future__ import annotations


class PdxferError(Exception):
    """Base of every error pdxfer raises on purpose."""


class InvalidInput(PdxferError, ValueError):
    """The caller's input is wrong; the message names the field. INVALID_ARGUMENT."""


class NotFound(PdxferError, LookupError):
    """The named thing (request, ticket, peer, file) does not exist. NOT_FOUND."""


class WrongState(PdxferError, RuntimeError):
    """Valid input, but not in the object's current state. FAILED_PRECONDITION."""


class CapacityError(PdxferError):
    """Not enough blocks, slots or memory right now, or ever. RESOURCE_EXHAUSTED."""


class PeerUnavailable(PdxferError, ConnectionError):
    """A peer process or rank group cannot be reached or is gone. UNAVAILABLE."""


class DeadlineExceeded(PdxferError, TimeoutError):
    """An operation ran past its deadline. DEADLINE_EXCEEDED."""


class TransferFailed(PdxferError):
    """A transfer failed. `settled` is True once none of its READs can still move bytes,
    so its destination blocks and slot may be reused; until then they must be held. ABORTED."""

    def __init__(self, message: str, *, settled: bool) -> None:
        super().__init__(message)
        self.settled = settled


class Closed(PdxferError, RuntimeError):
    """The object (transport, server, rank group) was closed. UNAVAILABLE."""


class Cancelled(PdxferError):
    """The caller went away (or cancelled) before the work was done. CANCELLED."""
