"""Control-plane errors and the gRPC status code each one maps to.

Bad input is a `ValueError` naming the field (INVALID_ARGUMENT). The server maps
these exceptions to status codes; the client raises `ControlError` with the code.
"""

from __future__ import annotations


class UnknownRequest(LookupError):
    """No live ticket for this request id (never published, or already freed). NOT_FOUND."""


class TicketStateError(RuntimeError):
    """The call is valid but not in the ticket's current state (e.g. held by another decode). FAILED_PRECONDITION."""


class CompatMismatch(RuntimeError):
    """The two sides of a handshake disagree on compatibility fields. FAILED_PRECONDITION."""

    def __init__(self, fields: list[str], message: str):
        super().__init__(message)
        self.fields = fields


class ControlError(Exception):
    """A failed control-plane call, as the client sees it.

    `code` is the gRPC status code name (e.g. "NOT_FOUND"); `details` the server's message.
    """

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


def status_code_name(exc: BaseException) -> str:
    """The gRPC status code name a servicer answers for `exc`."""
    if isinstance(exc, ControlError):
        return exc.code
    if isinstance(exc, UnknownRequest):
        return "NOT_FOUND"
    if isinstance(exc, (TicketStateError, CompatMismatch)):
        return "FAILED_PRECONDITION"
    if isinstance(exc, ValueError):
        return "INVALID_ARGUMENT"
    return "INTERNAL"
