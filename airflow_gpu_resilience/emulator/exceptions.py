"""Typed API errors carrying Google's canonical code and status.

Models, the backend and the request checks raise these; :func:`~.app.error_response` serializes
them in one place into Google's JSON error shape ``{"error": {"code", "message", "status"}}``,
which ``google.api_core.exceptions.from_http_response`` maps back to the matching exception.
"""

from __future__ import annotations


class EmulatorError(Exception):
    """Base API error.

    :param message: human-readable message, returned verbatim as ``error.message``.
    """

    http_code = 500
    grpc_code = 13
    status = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict:
        """Google's JSON error body for this error."""
        return {"error": {"code": self.http_code, "message": self.message, "status": self.status}}


class InvalidArgument(EmulatorError):
    http_code, grpc_code, status = 400, 3, "INVALID_ARGUMENT"


class FailedPrecondition(EmulatorError):
    http_code, grpc_code, status = 400, 9, "FAILED_PRECONDITION"


class PermissionDenied(EmulatorError):
    http_code, grpc_code, status = 403, 7, "PERMISSION_DENIED"


class PayloadTooLarge(EmulatorError):
    """A request body over the emulator's limit: HTTP 413; gRPC reports an oversized message
    as RESOURCE_EXHAUSTED."""

    http_code, grpc_code, status = 413, 8, "RESOURCE_EXHAUSTED"


class UnsupportedMediaType(EmulatorError):
    """A request body that is not JSON: HTTP 415, INVALID_ARGUMENT."""

    http_code, grpc_code, status = 415, 3, "INVALID_ARGUMENT"


class NotFound(EmulatorError):
    http_code, grpc_code, status = 404, 5, "NOT_FOUND"


class AlreadyExists(EmulatorError):
    http_code, grpc_code, status = 409, 6, "ALREADY_EXISTS"


class ResourceExhausted(EmulatorError):
    http_code, grpc_code, status = 429, 8, "RESOURCE_EXHAUSTED"


class Unavailable(EmulatorError):
    http_code, grpc_code, status = 503, 14, "UNAVAILABLE"


class Unimplemented(EmulatorError):
    http_code, grpc_code, status = 501, 12, "UNIMPLEMENTED"


class DeadlineExceeded(EmulatorError):
    http_code, grpc_code, status = 504, 4, "DEADLINE_EXCEEDED"
