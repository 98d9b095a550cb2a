"""Errors from the workers, as the OpenAI error shape and an HTTP status."""

from __future__ import annotations

from transfer.control.errors import ControlError, GrpcCode
from transfer.errors import (
    CapacityError,
    DeadlineExceeded,
    InvalidInput,
    NotFound,
    PeerUnavailable,
)
from transfer.serving.openai.schema import ApiError

# gRPC status code name -> (HTTP status, OpenAI error type)
_BY_CODE = {
    GrpcCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    GrpcCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    GrpcCode.NOT_FOUND: (404, "not_found_error"),
    GrpcCode.UNAUTHENTICATED: (401, "authentication_error"),
    GrpcCode.PERMISSION_DENIED: (403, "permission_error"),
    GrpcCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    GrpcCode.UNAVAILABLE: (503, "service_unavailable"),
    GrpcCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_BY_KIND = (
    (InvalidInput, GrpcCode.INVALID_ARGUMENT),
    (NotFound, GrpcCode.NOT_FOUND),
    (CapacityError, GrpcCode.RESOURCE_EXHAUSTED),
    (PeerUnavailable, GrpcCode.UNAVAILABLE),
    (DeadlineExceeded, GrpcCode.DEADLINE_EXCEEDED),
)


def api_error_of(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ControlError):
        code, message = exc.code, exc.details
    else:
        code = next((c for kind, c in _BY_KIND if isinstance(exc, kind)), GrpcCode.INTERNAL)
        message = str(exc) or type(exc).__name__
    status, kind = _BY_CODE.get(code, (500, "internal_error"))
    return ApiError(status, message, type=kind, code=code.lower())
