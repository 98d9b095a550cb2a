"""Control-plane errors, and the one place where an error's kind becomes a gRPC status.

Servicers raise the kinds of `transfer.errors`; `status_code_name` maps each kind to its
status code; the client raises `ControlError` carrying the code the server answered.
"""

from __future__ import annotations

from enum import StrEnum

import grpc

from transfer.errors import (
    Cancelled,
    CapacityError,
    Closed,
    DeadlineExceeded,
    InvalidInput,
    NotFound,
    PdxferError,
    PeerUnavailable,
    TransferFailed,
    WrongState,
)

# A gRPC status code by name, as it travels in DecodeEnd.code and in ControlError.code. A
# StrEnum, so a code compares equal to its name ("NOT_FOUND"); the members are grpc's own.
GrpcCode = StrEnum("GrpcCode", [(code.name, code.name) for code in grpc.StatusCode])


class UnknownRequest(NotFound):
    """No live ticket for this request id (never published, or already freed). NOT_FOUND."""


class TicketStateError(WrongState):
    """The call is valid but not in the ticket's current state (e.g. held by another decode). FAILED_PRECONDITION."""


class CompatMismatch(WrongState):
    """The two sides of a handshake disagree on compatibility fields. FAILED_PRECONDITION."""

    def __init__(self, fields: list[str], message: str):
        super().__init__(message)
        self.fields = fields


class NotPermitted(WrongState):
    """The caller may not do this to this ticket (Abort without its key, a ticket naming an
    unknown prefill instance). PERMISSION_DENIED."""


class ControlError(PdxferError):
    """A failed control-plane call, as the client sees it.

    `code` is the gRPC status code (a name such as "NOT_FOUND" is taken too; one that names
    no code becomes UNKNOWN); `details` the server's message.
    """

    def __init__(self, code: GrpcCode | str, details: str):
        self.code = GrpcCode(code) if code in GrpcCode.__members__ else GrpcCode.UNKNOWN
        super().__init__(f"{self.code}: {details}")
        self.details = details


# Most specific first: Closed is a RuntimeError like WrongState, but not a WrongState.
_CODES: tuple[tuple[type[BaseException], GrpcCode], ...] = (
    (InvalidInput, GrpcCode.INVALID_ARGUMENT),
    (NotPermitted, GrpcCode.PERMISSION_DENIED),
    (NotFound, GrpcCode.NOT_FOUND),
    (WrongState, GrpcCode.FAILED_PRECONDITION),
    (CapacityError, GrpcCode.RESOURCE_EXHAUSTED),
    (PeerUnavailable, GrpcCode.UNAVAILABLE),
    (DeadlineExceeded, GrpcCode.DEADLINE_EXCEEDED),
    (TransferFailed, GrpcCode.ABORTED),
    (Closed, GrpcCode.UNAVAILABLE),
    (Cancelled, GrpcCode.CANCELLED),
    # Bad input from code that raises the builtin (e.g. a protobuf field check).
    (ValueError, GrpcCode.INVALID_ARGUMENT),
)


def status_code_name(exc: BaseException) -> GrpcCode:
    """The gRPC status code a servicer answers for `exc`; INTERNAL for anything else."""
    if isinstance(exc, ControlError):
        return exc.code
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return GrpcCode.INTERNAL


def status_of(exc: BaseException) -> tuple[GrpcCode, str]:
    """(status code, details) a servicer answers for `exc`. A ControlError passed on
    from another server already carries its code: only its details are kept."""
    details = exc.details if isinstance(exc, ControlError) else str(exc)
    return status_code_name(exc), details or type(exc).__name__


def control_error_of(err: grpc.RpcError) -> ControlError:
    """The ControlError a client raises for a failed call."""
    # A grpc.RpcError raised by a call is also a grpc.Call, which carries the status.
    code = err.code() if isinstance(err, grpc.Call) else None
    details = err.details() if isinstance(err, grpc.Call) else str(err)
    return ControlError(code.name if code is not None else GrpcCode.UNKNOWN, details or "")
