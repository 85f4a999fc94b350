"""No child process may hold a file open for writing, so that none can finalize it early.

Cloud Storage FUSE uploads (finalizes) a file at every ``close()`` of a descriptor of it, and a process started while a
file is open holds its own copy of that descriptor. :func:`write_privately` writes on a short-lived thread that first
gives itself a descriptor table of its own (``unshare(CLONE_FILES)``), so no child, however it starts, ever holds the
file. The requirement (Linux with that call allowed: Cloud Run's second-generation environment), what happens where it
is refused, and why there is no other fallback: "On Cloud Storage FUSE" in ``docs/worker-contract.rst``.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")
_CLONE_FILES = 0x400  # unshare(2): unshare the file descriptor table (linux/sched.h)
_private_refused: int | None = None  # the errno of the first refused unshare; then no more tries
_private = threading.local()


def _unshare_files() -> int:
    """Give the calling thread a descriptor table of its own (a copy of the one it shared).

    :return: 0, or the ``errno`` of the refusal (``ENOSYS`` where there is no such call)."""
    if hasattr(os, "unshare"):  # Python 3.12 and later
        try:
            os.unshare(_CLONE_FILES)
        except OSError as exc:
            return exc.errno or errno.EPERM
        return 0
    if not sys.platform.startswith("linux"):
        return errno.ENOSYS
    try:
        unshare = ctypes.CDLL(None, use_errno=True).unshare
    except (OSError, AttributeError):
        return errno.ENOSYS
    unshare.argtypes, unshare.restype = [ctypes.c_int], ctypes.c_int
    return 0 if unshare(_CLONE_FILES) == 0 else (ctypes.get_errno() or errno.EPERM)


def in_private_files() -> bool:
    """
    :return: whether the calling thread runs in :func:`write_privately` with a descriptor table of its own (a
        thread it starts would share that table, and keep it alive)."""
    return getattr(_private, "active", False)


def private_files_refused() -> int | None:
    """
    :return: the ``errno`` with which ``unshare(CLONE_FILES)`` was refused in this process, or ``None`` (not
        refused, or not tried yet)."""
    return _private_refused


def write_privately(function: Callable[[], _T]) -> _T:
    """Run ``function`` (it opens, writes and closes files) on a new thread with its own descriptor table, and wait.

    The caller's signal handlers still run while it waits; an exception one of them raises reaches the caller once
    the thread has ended (nothing may clean up after a write still going on). ``function`` must close every
    descriptor it opens, hand none to another thread and start no threads (they would share its table). Where
    ``unshare`` is refused (:func:`private_files_refused`), ``function`` runs in the calling thread.

    :param function: a callable with no arguments.
    :return: what ``function`` returns.
    :raises BaseException: what ``function`` raises, re-raised in the caller."""
    if in_private_files():  # nested: the table is already this write's own
        return function()
    if _private_refused is None:
        wrote, value = _on_private_thread(function)
        if wrote:
            return value
    return function()


def _on_private_thread(function: Callable[[], _T]) -> tuple[bool, _T | None]:
    """Run ``function`` on a new thread that first unshares its descriptor table, and wait.

    :return: ``(True, its result)``; ``(False, None)`` when ``unshare`` was refused (then it did not run, and the
        refusal is remembered and logged).
    :raises BaseException: what ``function`` raises."""
    outcome: dict[str, object] = {}
    ended = threading.Event()  # not Thread.join: an interrupted join marks the thread ended (bpo-45274)

    def run() -> None:
        global _private_refused
        try:
            refused = _unshare_files()
            if refused:
                _private_refused = refused
                return
            _private.active = True
            outcome["value"] = function()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            outcome["error"] = exc
        finally:
            ended.set()

    threading.Thread(target=run, name=f"{threading.current_thread().name}-write", daemon=True).start()
    try:
        ended.wait()  # interruptible: the caller's signal handlers run while it waits
    except BaseException:
        # a signal handler raised (KeyboardInterrupt): the write goes on regardless, so let it end before the
        # caller cleans up after it (removing a file still being written); a second exception leaves at once
        ended.wait()
        raise
    error = outcome.get("error")
    if isinstance(error, BaseException):
        raise error
    if "value" not in outcome:
        logging.getLogger(__name__).warning(
            "unshare(CLONE_FILES) refused (%s): files are written in the caller, and a child process started during a "
            "write may finalize it early on Cloud Storage FUSE (the save then fails or is staged; a torn object never "
            "counts as a checkpoint)", errno.errorcode.get(_private_refused or 0, _private_refused))
        return False, None
    return True, outcome["value"]  # type: ignore[return-value]
