"""Exit codes (BSD sysexits) and the exceptions that map to them."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_DATAERR = 65
EXIT_CONFIG = 78
EXIT_PREEMPTED = 143


class WorkerError(Exception):
    """Base class for errors with a fixed process exit code.

    :param reason: human-readable explanation, written to the ``FATAL`` marker.
    """

    exit_code: int = EXIT_FAILURE

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ConfigError(WorkerError):
    """Bad configuration (flags or environment): not retryable, exit 78."""

    exit_code = EXIT_CONFIG


class DataError(WorkerError):
    """Unreadable or invalid input data: not retryable, exit 65."""

    exit_code = EXIT_DATAERR
