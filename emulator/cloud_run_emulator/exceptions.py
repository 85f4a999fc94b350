"""Typed API errors carrying Google's canonical code and status.

Models, the backend and the request checks raise these; :func:`~.app.error_response` serializes
them in one place into Google's JSON error shape ``{"error": {"code", "message", "status"}}``,
which ``google.api_core.exceptions.from_http_response`` maps back to the matching exception.

An error may carry details (``google.rpc`` messages such as ``ErrorInfo``, as Google's quota
errors do): REST lists them in ``error.details``, each as JSON with its ``@type``; gRPC sends
them in the ``google.rpc.Status`` of the ``grpc-status-details-bin`` trailer (see
:func:`~.grpc_server.status_details`). ``google-api-core`` reads them from either into the
exception's ``details``, ``reason`` and ``domain``.
"""

from __future__ import annotations

from typing import Sequence

from google.protobuf import any_pb2, json_format


class EmulatorError(Exception):
    """Base API error.

    :param message: human-readable message, returned verbatim as ``error.message``.
    :param details: ``google.rpc`` detail messages (e.g. ``ErrorInfo``, ``Help``); default none.
    """

    http_code = 500
    grpc_code = 13
    status = "INTERNAL"

    def __init__(self, message: str, details: Sequence = ()) -> None:
        super().__init__(message)
        self.message = message
        self.details = tuple(details)

    def packed_details(self) -> list:
        """The details, each packed in a ``google.protobuf.Any``."""
        packed = []
        for detail in self.details:
            wrapper = any_pb2.Any()
            wrapper.Pack(detail)
            packed.append(wrapper)
        return packed

    def to_dict(self) -> dict:
        """Google's JSON error body for this error (``details`` only when it has some)."""
        error = {"code": self.http_code, "message": self.message, "status": self.status}
        if self.details:
            error["details"] = [json_format.MessageToDict(wrapper) for wrapper in self.packed_details()]
        return {"error": error}


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
