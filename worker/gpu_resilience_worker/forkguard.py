"""No ``os.fork()`` while a file is open for writing, so that no child can finalize it early.

The kernel sends a FUSE file system a flush at every ``close()`` of a descriptor, and a process
forked while a file is open holds its own copy of that descriptor, closed when the child exits or
execs. Cloud Storage FUSE uploads (finalizes) a file at each flush, whoever sends it: a
``DataLoader`` worker or ``multiprocessing`` helper forked during a background save and gone
before the save ends would publish the checkpoint's first bytes as the object, and the writer's
next write would then be a staged rewrite of the whole file (on Cloud Run, memory; ``EIO`` on
the emulator's strict volume). The commit protocol never lets such an object count as a
checkpoint; this guard keeps the upload whole.

:func:`writing` marks a file open for writing; an ``os.fork()`` in another thread meanwhile
(``multiprocessing``'s ``fork`` start method, a ``DataLoader``'s workers) waits, in an
:func:`os.register_at_fork` hook, until no such file is open, at most :data:`FORK_WAIT_LIMIT_S`.
``subprocess`` does not run those hooks: a subprocess started while a save writes still flushes
the file at its ``exec`` (see worker/README.md, "On Cloud Storage FUSE").
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

#: Seconds an ``os.fork()`` waits at most for the open writes to end; after that it goes on (the
#: file may then be staged, never torn: the commit record follows only a whole, closed file).
FORK_WAIT_LIMIT_S = 300.0


class _Guard:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.writers: dict[int, int] = {}  # thread ident -> files it has open for writing
        self.registered = False

    def open_writes(self) -> int:
        with self.cond:
            return sum(self.writers.values())

    def enter(self) -> None:
        with self.cond:
            if not self.registered and hasattr(os, "register_at_fork"):
                os.register_at_fork(before=self.before_fork, after_in_parent=self.after_fork_in_parent,
                                    after_in_child=self.after_fork_in_child)
                self.registered = True
            me = threading.get_ident()
            self.writers[me] = self.writers.get(me, 0) + 1

    def leave(self) -> None:
        with self.cond:
            me = threading.get_ident()
            self.writers[me] -= 1
            if not self.writers[me]:
                del self.writers[me]
            if not self.writers:
                self.cond.notify_all()

    def before_fork(self) -> None:
        # held from here through the fork, so that no write opens in between
        self.cond.acquire()
        if threading.get_ident() in self.writers:
            return  # the writing thread forks itself: waiting would never end
        self.cond.wait_for(lambda: not self.writers, timeout=FORK_WAIT_LIMIT_S)

    def after_fork_in_parent(self) -> None:
        self.cond.release()

    def after_fork_in_child(self) -> None:
        # the child has only the forking thread: no writes, and a fresh (unlocked) condition
        self.cond = threading.Condition()
        self.writers = {}


_GUARD = _Guard()


@contextlib.contextmanager
def writing() -> Iterator[None]:
    """Mark a file open for writing for the duration of the block: an ``os.fork()`` in another
    thread waits until it ends (at most :data:`FORK_WAIT_LIMIT_S`). Nests; any thread."""
    _GUARD.enter()
    try:
        yield
    finally:
        _GUARD.leave()


def open_writes() -> int:
    """:return: how many files the guarded writers of this process have open now."""
    return _GUARD.open_writes()
