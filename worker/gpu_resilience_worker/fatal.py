"""The ``FATAL`` marker: a process whose error would happen again on every retry writes ``{namespace}/FATAL`` and
exits with its code; a later attempt of the same invocation exits at once with that code instead of burning a GPU
attempt. Which codes are obeyed, and when 73 and 74 are looked at again: the exit codes and the ``FATAL`` row of
``docs/worker-contract.rst``. Used by :class:`~gpu_resilience_worker.loop.ResilientLoop`."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import traceback
from typing import Callable, Sequence

from gpu_resilience_worker.commit import CheckpointName, read_record
from gpu_resilience_worker.errors import (EXIT_CANTCREAT, EXIT_FAILURE, EXIT_IOERR, NewerCheckpointError, OutputError,
                                          WorkerError)
from gpu_resilience_worker.files import read_json, write_json
from gpu_resilience_worker.logs import StructuredLogger, utc_now
from gpu_resilience_worker.storage import LocalStorage
from gpu_resilience_worker.task_folder import ATTEMPTS, FATAL, METRICS, PROGRESS, WRITE_PROBE


def invocation(argv: Sequence[str], data_path: str | None = None) -> dict:
    """What a ``FATAL`` marker is tied to: the arguments, and the input file's size and mtime.

    :param argv: the worker's arguments.
    :param data_path: the ``.npz`` input, when the configuration got as far as naming it.
    :return: ``{"argv": [...], "data": [size in bytes, mtime in ns] or None}``.
    """
    try:
        stat = os.stat(data_path) if data_path else None
    except OSError:
        stat = None
    return {"argv": list(argv), "data": [stat.st_size, stat.st_mtime_ns] if stat else None}


def free_bytes(folder: str) -> int | None:
    """
    :return: the bytes an unprivileged writer may still use on ``folder``'s file system (``statvfs``: available
        blocks times the fragment size), or ``None`` when it cannot be asked."""
    try:
        info = os.statvfs(folder)
    except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
        return None
    return info.f_bavail * info.f_frsize


def space_came_back(recorded: object, now: int | None) -> bool:
    """Whether a ``FATAL`` marker of a full file system (exit 74) no longer holds.

    :param recorded: the marker's ``free_bytes`` (read from a file: anything, ``None`` included).
    :param now: :func:`free_bytes` of the folder now; ``None`` when unknown.
    :return: ``True`` only when both are byte counts and more is free now; an unknown count keeps
        the marker (a volume whose free-space figure never changes keeps it until it is removed).
    """
    return all(isinstance(v, int) and not isinstance(v, bool) for v in (recorded, now)) and now > recorded


def write_fatal(namespace: str | None, error: WorkerError, logger: StructuredLogger,
                called_as: dict | None = None) -> int:
    """Record a non-retryable error in ``{namespace}/FATAL`` and log it in ONE error line. A marker that already
    records the same exit code, reason and invocation (a retry of an invocation whose configuration is invalid
    fails before :func:`fatal_marker_code` can be asked) is kept, not rewritten (on a Cloud Storage FUSE volume
    each rewrite is a mutation of the same object name): the line says ``fatal_marker_kept``.

    :param namespace: the task namespace, or ``None`` when not even a best guess is known (nothing is written).
    :param error: the non-retryable error; its ``exit_code`` is returned.
    :param logger: where the error line goes.
    :param called_as: the :func:`invocation` that failed; a later attempt with the same one exits at once, one with
        other arguments or another input file ignores the marker.
    :return: the error's exit code.
    """
    marker, kept = "not written: no namespace", False
    if namespace is not None:
        record = {"exit_code": error.exit_code, "reason": error.reason, "created_at": utc_now(),
                  "invocation": called_as, **error.marker_fields}
        if error.exit_code == EXIT_IOERR:  # a full disk: obeyed until more space is free
            record["free_bytes"] = free_bytes(namespace)
        path = os.path.join(namespace, FATAL)
        try:
            existing = read_json(LocalStorage(), path) if os.path.isfile(path) else None
            kept = existing is not None and all(existing.get(key) == record[key]
                                                for key in ("exit_code", "reason", "invocation"))
            if not kept:
                write_json(LocalStorage(), path, record)
            marker = path
        except OSError as exc:
            marker = f"not written: {exc}"
    logger.error(f"fatal: {error.reason}", exit_code=error.exit_code, reason=error.reason,
                 fatal_marker=marker, **({"fatal_marker_kept": True} if kept else {}))
    return error.exit_code


#: The file names the worker writes in a task namespace, besides its checkpoints' names.
OWN_FILES = (PROGRESS, METRICS, ATTEMPTS, FATAL, WRITE_PROBE)


def _in_the_way(namespace: str) -> list[str]:
    """:return: the entries of ``namespace`` named like a file the worker writes (:data:`OWN_FILES`, a checkpoint's
    data file, commit record or their temporary files) but folders: no write of that name could ever succeed."""
    found = []
    for name in sorted(os.listdir(namespace)):
        if name in OWN_FILES or CheckpointName.parse(name) is not None:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(os.lstat(os.path.join(namespace, name)).st_mode):
                    found.append(name)
    return found


def check_writable(namespace: str) -> None:
    """Create the namespace and write (then remove) a probe file in it, and check that no folder carries the name
    of a file the worker writes there.

    :raises OutputError: when it cannot be created or written for good (permission, read-only file system, a file
        in the way, a folder named like one of the worker's files: every retry would fail the same way, e.g. at its
        final checkpoint). Other ``OSError`` (e.g. EIO) propagate: retryable.
    """
    probe = os.path.join(namespace, WRITE_PROBE)
    blocking = _in_the_way(namespace) if os.path.isdir(namespace) else []
    if blocking:
        raise OutputError(f"checkpoint folder {namespace} has folders named like the worker's own files "
                          f"({', '.join(blocking)}); remove them (their contents are not the worker's)")
    try:
        os.makedirs(namespace, exist_ok=True)
        LocalStorage().write(probe, b"probe")
        os.remove(probe)
    except OSError as exc:
        with contextlib.suppress(OSError):  # a probe that failed half-way (a full disk) is not left behind
            if not os.path.islink(probe):
                os.remove(probe)
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
            raise OutputError(f"checkpoint folder {namespace} is not writable: {exc.strerror or exc}") from None
        raise


def _newer_record_still_there(newer: object, logger: StructuredLogger) -> bool:
    """Whether a marker's ``newer_record`` (anything read from the file; ``None``: no such field; see
    :class:`~gpu_resilience_worker.errors.NewerCheckpointError`) still holds: ``True`` unless it names a record
    that, read again (one small file), this release reads now or that is gone."""
    if not isinstance(newer, dict) or not isinstance(newer.get("file"), str):
        return True
    try:
        read_record(LocalStorage(), newer["file"])
    except NewerCheckpointError:
        return True
    except (OSError, ValueError):
        pass
    logger.info("a FATAL marker of a newer release's commit record, which this release reads now or which is gone: "
                "trying again", file=newer["file"])
    return False


def fatal_marker_code(namespace: str, logger: StructuredLogger, called_as: dict | None = None) -> int | None:
    """The exit code of an earlier attempt's ``FATAL`` marker, if it applies. A stale one is removed: one written
    for another :func:`invocation` (other arguments, or an input file changed since; with a warning), one of exit 73
    (the folder is checked again), one of exit 74 with more free space now (:func:`space_came_back`), and one of a
    newer release's commit record that this release reads, or that is gone.

    :return: the marker's exit code (64 to 78, else 78), or ``None`` (no marker, or a stale one).
    """
    path = os.path.join(namespace, FATAL)
    if not os.path.exists(path) or os.path.isdir(path):
        return None  # a folder: check_writable refuses it (exit 73), not a marker any attempt wrote
    record = read_json(LocalStorage(), path)
    if record is None or not isinstance(record.get("exit_code"), int):
        # written whole (temporary file, then rename): a garbled one is not ours; obeyed, it would fail every attempt
        logger.warning("ignoring an unreadable FATAL marker; removing it", file=path)
        with contextlib.suppress(OSError):
            LocalStorage().remove(path)
        return None
    if record["exit_code"] == EXIT_CANTCREAT:
        # check_writable looks again first, in no time: a folder fixed since must not stay refused by its marker
        logger.info("a FATAL marker of an unwritable checkpoint folder: checking the folder again", file=path)
    elif not _newer_record_still_there(record.get("newer_record"), logger):
        pass  # it logged why
    elif record["exit_code"] == EXIT_IOERR and space_came_back(record.get("free_bytes"), free_bytes(namespace)):
        logger.info("a FATAL marker of a full checkpoint folder, which has more free space now: trying again",
                    file=path, free_bytes_then=record.get("free_bytes"), free_bytes_now=free_bytes(namespace))
    elif called_as is not None and record.get("invocation") not in (None, called_as):
        logger.warning("ignoring a FATAL marker left by other settings or input; removing it",
                       file=path, reason=record.get("reason"))
    else:
        code = record["exit_code"] if 64 <= record["exit_code"] <= 78 else 78
        logger.error("an earlier attempt hit a non-retryable error; exiting at once",
                     exit_code=code, reason=record.get("reason"), file=path)
        return code
    LocalStorage().remove(path)
    return None


def run_guarded(namespace: str, logger: StructuredLogger, called_as: dict | None, body: Callable[[], int]) -> int:
    """Run one attempt's ``body`` under the exit-code rules: not at all when an earlier attempt's ``FATAL`` marker
    applies (:func:`fatal_marker_code`).

    :param namespace: the task folder.
    :param logger: where the error lines go.
    :param called_as: the :func:`invocation` a marker is tied to.
    :param body: the attempt; returns its exit code.
    :return: that code, the marker's, a :class:`WorkerError`'s (``FATAL`` written), or 1 for any other exception
        (logged with its traceback: retryable).
    """
    if (code := fatal_marker_code(namespace, logger, called_as)) is not None:
        return code
    try:
        return body()
    except WorkerError as exc:
        return write_fatal(namespace, exc, logger, called_as)
    except Exception as exc:  # noqa: BLE001 - the retryable catch-all
        logger.error(f"unexpected error: {exc!r}", exit_code=EXIT_FAILURE, traceback=traceback.format_exc())
        return EXIT_FAILURE
