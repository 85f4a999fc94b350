"""Which Cloud Run Admin API errors are retried, and how: the provider's one retry policy.

Idempotent reads and writes retry :data:`TRANSIENT_ERRORS`; RunJob, which is not idempotent,
retries only :data:`REJECTED_ERRORS` (the request surely was not applied) and treats
:data:`AMBIGUOUS_ERRORS` as "an execution may have started" (see
:meth:`~airflow_gpu_resilience.hooks.cloud_run_executions.CloudRunExecutionsMixin.start_execution`).
Backoff is google-api-core's ``Retry``.
"""

from __future__ import annotations

import requests
from google.api_core import exceptions as gexc
from google.api_core.retry import Retry, if_exception_type

__all__ = ["AMBIGUOUS_ERRORS", "REJECTED_ERRORS", "TRANSIENT_ERRORS", "default_retry", "error_status"]

#: Errors worth retrying for idempotent calls (503 UNAVAILABLE, 429 RESOURCE_EXHAUSTED, 504
#: DEADLINE_EXCEEDED or a gateway's 504, a gateway's 502, and a REST connection that broke or
#: timed out). Over REST the client maps by HTTP code, so a 504 arrives as ``GatewayTimeout``
#: (the base class of ``DeadlineExceeded``).
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    gexc.ServiceUnavailable,
    gexc.TooManyRequests,
    gexc.ResourceExhausted,
    gexc.GatewayTimeout,
    gexc.BadGateway,
    requests.ConnectionError,
    requests.Timeout,
)
#: For non-idempotent calls (RunJob) only errors where the request surely was not applied.
REJECTED_ERRORS: tuple[type[Exception], ...] = (gexc.ServiceUnavailable, gexc.TooManyRequests)
#: Errors after which a RunJob may or may not have started an execution.
AMBIGUOUS_ERRORS: tuple[type[Exception], ...] = (
    gexc.GatewayTimeout,  # and its subclass DeadlineExceeded
    gexc.BadGateway,
    gexc.InternalServerError,
    gexc.RetryError,
    requests.ConnectionError,
    requests.Timeout,
)
def default_retry(
    errors: tuple[type[Exception], ...] = TRANSIENT_ERRORS, deadline: float = 120.0, initial: float = 1.0
) -> Retry:
    """Exponential backoff retry (``initial`` s, x2, capped at 20 s, with jitter) on transient errors.

    :param errors: exception types to retry.
    :param deadline: give up after this many seconds in total (default 120), raising
        ``google.api_core.exceptions.RetryError``.
    :param initial: first delay in seconds (default 1).
    :return: a ``google.api_core.retry.Retry``.
    """
    return Retry(
        predicate=if_exception_type(*errors), initial=initial, multiplier=2.0, maximum=20.0, timeout=deadline
    )


def error_status(exc: BaseException) -> str | None:
    """The ``google.rpc`` status name of an API error (e.g. ``"FAILED_PRECONDITION"``).

    The REST transport maps errors by HTTP code only (INVALID_ARGUMENT and FAILED_PRECONDITION
    both arrive as ``BadRequest``, whose class-level gRPC code is INVALID_ARGUMENT), so the
    status in the response body (``error.status``) wins; the gRPC code is the fallback.

    :param exc: an exception raised by a Cloud Run client.
    :return: the status name, or ``None`` when it cannot be told.
    """
    response = getattr(exc, "response", None)
    try:
        status = response.json()["error"]["status"]
        if isinstance(status, str) and status:
            return status
    except (AttributeError, TypeError, ValueError, KeyError):
        pass
    code = getattr(exc, "grpc_status_code", None)
    return getattr(code, "name", None)
