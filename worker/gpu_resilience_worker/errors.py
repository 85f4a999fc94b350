"""Exit codes (BSD sysexits) and the exceptions that map to them."""

from __future__ import annotations

import math
from typing import Any

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_DATAERR = 65
EXIT_SOFTWARE = 70
EXIT_CANTCREAT = 73
EXIT_IOERR = 74
EXIT_CONFIG = 78
#: Interrupted (SIGTERM, SIGINT or the task deadline); resumable from the last commit.
EXIT_PREEMPTED = 143


class WorkerError(Exception):
    """Base class for errors with a fixed process exit code.

    :param reason: human-readable explanation, written to the ``FATAL`` marker."""

    exit_code: int = EXIT_FAILURE

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        #: further fields of the ``FATAL`` marker (JSON types), beside ``exit_code`` and ``reason``
        self.marker_fields: dict[str, Any] = {}


class ConfigError(WorkerError):
    """Bad configuration (flags or environment): not retryable, exit 78."""

    exit_code = EXIT_CONFIG


class NewerCheckpointError(ConfigError):
    """A commit record written by a newer release of the worker (a ``format`` or a chunk ``digest`` this release
    does not know): not a torn record (not a ``ValueError``), and not retryable: exit 78, nothing in the folder is
    deleted (why: :mod:`gpu_resilience_worker.task_folder`). The ``FATAL`` marker records ``newer_record`` =
    ``{file, format, digest}``, obeyed only while that record still cannot be read
    (:func:`~gpu_resilience_worker.fatal.fatal_marker_code`).

    :param detail: what is newer, in words (e.g. ``format 99 (this release reads formats up to 1)``).
    :param format: the record's ``format`` when that is the newer part, else ``None``.
    :param digest: its unknown digest when that is the newer part, else ``None``.
    :param record: the record's path; ``""`` while only its bytes are known."""

    def __init__(self, detail: str, format: int | None = None, digest: str | None = None, record: str = "") -> None:
        super().__init__(f"commit record {record} has {detail}: a newer release of the worker wrote it (was the "
                         "image rolled back?); nothing was resumed or deleted. Run a release that reads it, or move "
                         "that checkpoint out of the folder to resume from an older one")
        self.detail, self.record, self.format, self.digest = detail, record, format, digest
        self.marker_fields = {"newer_record": {"file": record, "format": format, "digest": digest}}


class DataError(WorkerError):
    """Unreadable or invalid input data: not retryable, exit 65."""

    exit_code = EXIT_DATAERR


class OutputError(WorkerError):
    """The checkpoint folder cannot be created or written (permission, read-only, a file in the way): not
    retryable, exit 73 (``EX_CANTCREAT``)."""

    exit_code = EXIT_CANTCREAT


class OutOfSpaceError(WorkerError):
    """The checkpoint folder's file system has no room for a checkpoint (ENOSPC, or EDQUOT: a quota), and
    :data:`~gpu_resilience_worker.policies.MAX_FAILED_SAVES_IN_A_ROW` saves failed in a row for it: not retryable,
    exit 74 (``EX_IOERR``). Its ``FATAL`` marker also records the free space then; a later attempt that finds more
    goes on (:func:`~gpu_resilience_worker.fatal.fatal_marker_code`).

    :param reason: names the folder and the error (``No space left on device``)."""

    exit_code = EXIT_IOERR


class SavesFailingError(Exception):
    """:data:`~gpu_resilience_worker.policies.MAX_FAILED_SAVES_IN_A_ROW` checkpoint saves failed in a row, not for
    want of space: the attempt ends with exit 1 (retryable: a mount's EIO may pass). Not a
    :class:`~gpu_resilience_worker.checkpoint.CheckpointSaveError`, which a loop answers by going on without it."""


class DivergedError(WorkerError):
    """Training diverged (a non-finite loss): the same settings diverge again, exit 70."""

    exit_code = EXIT_SOFTWARE


def check_number(name: str, value: Any, *, minimum: float, integer: bool = False, strict: bool = False) -> None:
    """Refuse a parameter that is not an int (``integer``) or a finite number, at least ``minimum`` (above: ``strict``).

    :raises ValueError: ``{name} must be ...``, naming the parameter as the caller wrote it."""
    kind = "an int" if integer else "a finite number"
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    if not (ok and math.isfinite(value) and (value > minimum if strict else value >= minimum)):
        raise ValueError(f"{name} must be {kind} {'>' if strict else '>='} {minimum:g}, got {value!r}")
