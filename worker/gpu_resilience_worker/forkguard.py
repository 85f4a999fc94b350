"""No child process may hold a file open for writing, so that none can finalize it early.

The kernel sends a FUSE file system a flush at every ``close()`` of a descriptor, and a process
forked while a file is open holds its own copy of that descriptor, closed when the child exits or
execs. Cloud Storage FUSE uploads (finalizes) a file at each flush, whoever sends it: a
``DataLoader`` worker or ``multiprocessing`` helper forked during a background save and gone
before the save ends would publish the checkpoint's first bytes as the object, and the writer's
next write would then be a staged rewrite of the whole file (on Cloud Run, memory; ``EIO`` on
the emulator's strict volume). The commit protocol never lets such an object count as a
checkpoint; this module keeps the upload whole, in one of two ways.

:func:`write_privately` (Linux, the default) opens and writes the file on a short-lived thread
that first gives itself a descriptor table of its own (``unshare(CLONE_FILES)``): the file is in
no other thread's table, so no child, however it starts (``os.fork()``, ``subprocess``, the
``spawn`` and ``forkserver`` start methods of ``multiprocessing``), ever holds it, and no fork has
to wait.

Where ``unshare`` is refused (another kernel, a sandbox), or :data:`PRIVATE_FILES` is false, the
write runs in the caller under :func:`writing`, the fallback below.

:func:`writing` marks a file open for writing; an ``os.fork()`` meanwhile (``multiprocessing``'s
``fork`` start method, a ``DataLoader``'s workers) waits, in an :func:`os.register_at_fork` hook,
until no other thread has such a file open (a thread whose own fork waits excepted), and no new
write opens while a fork waits. The wait
ends early, and the fork goes ahead, when

- a check registered with :func:`stop_waiting_when` returns true (the worker's
  :class:`~gpu_resilience_worker.preemption.PreemptionWatcher` registers one that is true once the
  grace period after a stop request is nearly spent: the fork still waits for a save that can
  commit in time, and the loop still answers the SIGTERM before the kill);
- a signal handler raises during the wait (``KeyboardInterrupt``, ``sys.exit`` in a handler):
  CPython ignores exceptions raised in fork hooks (it prints them as "Exception ignored"), so the
  exception cannot reach the code that forked; the guard stops waiting and warns;
- :data:`FORK_WAIT_LIMIT_S` passes (with a :class:`RuntimeWarning`).

Not covered by the fallback, because they run no fork hooks: ``subprocess`` and the ``spawn``
and ``forkserver`` start methods (the default of ``multiprocessing`` on Python 3.14 is
``forkserver``). Each starts a program, and the ``exec`` closes the inherited descriptor, which
flushes it (see docs/worker-contract.rst, "On Cloud Storage FUSE").
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - imported for its fork hook's place: see below
import contextlib
import ctypes
import errno
import logging  # noqa: F401 - imported for its fork hook's place: see below
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TypeVar

_T = TypeVar("_T")

#: Seconds an ``os.fork()`` waits at most for the open writes to end; after that it goes on (the
#: file may then be staged, never torn: the commit record follows only a whole, closed file).
FORK_WAIT_LIMIT_S = 300.0

#: Seconds between two looks at the stop checks while a fork waits.
_POLL_S = 0.05


class _Guard:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.writers: dict[int, int] = {}  # thread ident -> files it has open for writing
        self.forking: dict[int, int] = {}  # thread ident -> its forks waiting now (a signal handler's nest)
        self.stop_checks: list[Callable[[], bool]] = []

    @property
    def forks_waiting(self) -> int:
        return sum(self.forking.values())

    def open_writes(self) -> int:
        with self.cond:
            return sum(self.writers.values())

    def depth(self) -> int:
        """:return: the files this thread has open for writing."""
        with self.cond:
            return self.writers.get(threading.get_ident(), 0)

    def enter(self) -> None:
        with self.cond:
            me = threading.get_ident()
            if me not in self.writers:  # a first write waits for the forks waiting (no starvation)
                self.cond.wait_for(lambda: not self.forks_waiting)
            self.writers[me] = self.writers.get(me, 0) + 1

    def leave_to(self, depth: int) -> None:
        """Set this thread's count back to ``depth``, its value before the block: right also when a
        signal handler raised inside :meth:`enter`, before or after its increment."""
        with self.cond:
            me = threading.get_ident()
            if depth > 0:
                self.writers[me] = depth
            else:
                self.writers.pop(me, None)
            self.cond.notify_all()

    def stop_requested(self) -> bool:
        return any(check() for check in list(self.stop_checks))

    def before_fork(self) -> None:
        # held from here through the fork, so that no write opens in between
        self.cond.acquire()
        me = threading.get_ident()

        def others_done() -> bool:
            # the forking thread's own writes cannot end while it waits, nor those of a thread
            # whose own fork waits (two threads forking inside their writes would wait for
            # each other until the limit): the fork goes ahead with those files open
            return not any(ident != me and not self.forking.get(ident) for ident in self.writers)

        if others_done():
            return
        until = time.monotonic() + FORK_WAIT_LIMIT_S
        waiting = self.forking.get(me, 0)  # restored in the finally, whatever a signal handler raises
        try:
            self.forking[me] = waiting + 1
            while not others_done():
                if self.stop_requested():
                    return
                left = until - time.monotonic()
                if left <= 0:
                    warnings.warn(f"os.fork() went ahead after {FORK_WAIT_LIMIT_S:g} s with a file still open "
                                  "for writing: on Cloud Storage FUSE that file may be staged",
                                  RuntimeWarning, stacklevel=2)
                    return
                self.cond.wait(min(_POLL_S, left))
        except BaseException as exc:  # noqa: BLE001 - raised by a signal handler; CPython drops it
            warnings.warn(f"os.fork() stopped waiting for an open write: a signal handler raised {exc!r}, "
                          "which CPython ignores inside a fork hook", RuntimeWarning, stacklevel=2)
        finally:
            if waiting:
                self.forking[me] = waiting
            else:
                self.forking.pop(me, None)

    def after_fork_in_parent(self) -> None:
        self.cond.notify_all()  # the writes held back while the fork waited
        self.cond.release()

    def after_fork_in_child(self) -> None:
        # the child has only the forking thread, with its own writes (left in the child as in
        # the parent), and needs a fresh, unlocked condition
        me = threading.get_ident()
        self.writers = {me: self.writers[me]} if me in self.writers else {}
        self.forking = {}
        self.cond = threading.Condition()


_GUARD = _Guard()
# Registered once, at import. Before-fork hooks run in the reverse order of registration, and a
# hook that takes a lock holds it through the whole fork: had logging's (its module lock) or
# concurrent.futures' (the lock of every ThreadPoolExecutor.submit) run before this wait, a save
# that logs or hands a chunk to its digest threads would block on that lock while the fork waits
# for the save, until FORK_WAIT_LIMIT_S. Both are imported above, so their hooks are registered
# first and run after this one, whatever the user imports first. A library imported later whose
# own hook takes a lock the writer needs would still run first; none of the worker's does.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_GUARD.before_fork, after_in_parent=_GUARD.after_fork_in_parent,
                        after_in_child=_GUARD.after_fork_in_child)


@contextlib.contextmanager
def writing() -> Iterator[None]:
    """Mark a file open for writing for the duration of the block: an ``os.fork()`` in another
    thread waits until it ends (at most :data:`FORK_WAIT_LIMIT_S`, less on a stop request), and a
    first write of a thread waits while a fork waits. Nests; any thread."""
    depth = _GUARD.depth()
    try:
        _GUARD.enter()
        yield
    finally:
        _GUARD.leave_to(depth)


def open_writes() -> int:
    """:return: how many files the guarded writers of this process have open now."""
    return _GUARD.open_writes()


def stop_waiting_when(check: Callable[[], bool]) -> None:
    """Make a waiting ``os.fork()`` go ahead as soon as ``check()`` returns true (it is called
    every 50 ms while a fork waits, from the forking thread; it must not fork or write).

    :param check: a callable with no arguments, for example a stop request's flag.
    """
    _GUARD.stop_checks.append(check)


def forget_stop_check(check: Callable[[], bool]) -> None:
    """Remove a check added with :func:`stop_waiting_when` (no error when it is not there)."""
    with contextlib.suppress(ValueError):
        _GUARD.stop_checks.remove(check)


#: Whether :func:`write_privately` gives its writes a descriptor table of their own (default
#: true). False: every write runs in its caller under :func:`writing` (the fork-hook fallback).
PRIVATE_FILES = True

_CLONE_FILES = 0x400  # unshare(2): unshare the file descriptor table (linux/sched.h)
_private_refused: int | None = None  # the errno of the first refused unshare; then no more tries
_private = threading.local()


def _unshare_files() -> int:
    """Give the calling thread a descriptor table of its own (a copy of the one it shared).

    :return: 0, or the ``errno`` of the refusal (``ENOSYS`` where there is no such call).
    """
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
    :return: whether the calling thread runs in :func:`write_privately` with a descriptor
        table of its own (a thread it starts would share that table, and keep it alive)."""
    return getattr(_private, "active", False)


def private_files_refused() -> int | None:
    """
    :return: the ``errno`` with which ``unshare(CLONE_FILES)`` was refused in this process, or
        ``None`` (not refused, or not tried yet)."""
    return _private_refused


def write_privately(function: Callable[[], _T]) -> _T:
    """Run ``function``, which opens, writes and closes files, where no child process can ever
    hold those files: on a new thread with a descriptor table of its own.

    The caller waits for the thread and gets its result or its exception; its signal handlers
    still run while it waits (the main thread's, for a SIGTERM). An exception one of them raises
    reaches the caller once the thread has ended, so that nothing cleans up after a write still
    going on; a second one meanwhile reaches it at once. ``function`` must close every
    descriptor it opens and hand none to another thread (its numbers mean nothing there, or
    another file), and start no threads (they would share its table). The table starts as a copy
    of the process's: a descriptor another thread closes meanwhile is released when the write
    ends.

    Without ``unshare`` (see :func:`private_files_refused`), or with :data:`PRIVATE_FILES` false,
    ``function`` runs in the calling thread under :func:`writing`: an ``os.fork()`` elsewhere
    then waits for it, and a ``subprocess`` or a spawned process started meanwhile may still
    finalize the file early.

    :param function: a callable with no arguments.
    :return: what ``function`` returns.
    :raises BaseException: what ``function`` raises, re-raised in the caller.
    """
    if in_private_files():  # nested: the table is already this write's own
        return function()
    if PRIVATE_FILES and _private_refused is None:
        wrote, value = _on_private_thread(function)
        if wrote:
            return value
    with writing():
        return function()


def _on_private_thread(function: Callable[[], _T]) -> tuple[bool, _T | None]:
    """Run ``function`` on a new thread that first unshares its descriptor table, and wait.

    :return: ``(True, its result)``; ``(False, None)`` when ``unshare`` was refused (then it did
        not run, and the refusal is remembered and logged).
    :raises BaseException: what ``function`` raises.
    """
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
        # a signal handler raised (KeyboardInterrupt): the write goes on regardless, so let it
        # end before the caller cleans up after it (it would remove a file still being written);
        # a second exception meanwhile leaves at once
        ended.wait()
        raise
    error = outcome.get("error")
    if isinstance(error, BaseException):
        raise error
    if "value" not in outcome:
        logging.getLogger(__name__).warning(
            "unshare(CLONE_FILES) refused (%s): files are written under the fork guard instead, and a "
            "subprocess or a spawned process started during a write may finalize it early on Cloud "
            "Storage FUSE", errno.errorcode.get(_private_refused or 0, _private_refused))
        return False, None
    return True, outcome["value"]  # type: ignore[return-value]
