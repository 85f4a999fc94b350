"""The mount process's open files: a writer's state (gcsfuse's inode of one task's mount), a
reader's, the table of FUSE file handles, and the local copies (staging files) writers write to.

Bookkeeping only: what the writers' states mean, and when a file streams or is staged, is
:mod:`.gcsfuse_writes` (gcsfuse's ``docs/semantics.md``, "Streaming Writes" and "Staged Writes").
Imported by the mount process only (:mod:`.gcsfuse_process`); no FUSE library here.
"""

from __future__ import annotations

import os
import stat as statmod
import threading

from .gcsfuse_events import task_of
from .gcsfuse_rules import shows_local_copy


class Writer:
    """A file open for writing on one task's mount (gcsfuse's inode): its local copy (a staging
    file) and its state, shared by every handle that task opens on it while it is being written
    (``refs``); another task's open of the same object is another writer (another mount).

    :param path: the mount's path of the file (``/name``).
    :param fd: descriptor of the local copy (read and write).
    :param temp: the local copy's path, ``None`` once a close published it as the object.
    :param base: :func:`generation` of the object when opened or last uploaded (``None``: absent).
    :param who: the opener's :func:`~.gcsfuse_events.identity`.
    :param opened_existing: it opened an existing object (its bytes are the object's until a
        write or truncation fetches them).
    """

    __slots__ = ("path", "fd", "temp", "base", "mode", "cause", "next_offset", "who", "finalized", "dirty",
                 "unlinked", "reads", "opened_existing", "refs")

    def __init__(self, path: str, fd: int, temp, base, who: dict, opened_existing: bool) -> None:
        self.path, self.fd, self.temp, self.base, self.who = path, fd, temp, base, who
        self.mode = None  # None: nothing written yet; "stream" | "staged"
        self.cause = None
        self.next_offset = 0
        self.finalized = False
        self.dirty = False
        self.unlinked = False
        self.reads = 0
        self.opened_existing = opened_existing
        self.refs = 1

    @property
    def local(self) -> bool:
        """Whether the local copy is what the file is (see :func:`~.gcsfuse_rules.shows_local_copy`)."""
        return shows_local_copy(self.mode, self.dirty, self.opened_existing)


class Reader:
    """A file open for reading: its descriptor and the bytes read since the last record.

    :param path: the mount's path of the file.
    :param fd: descriptor of the object (or of a task's staged local copy).
    :param who: the opener's identity.
    """

    __slots__ = ("path", "fd", "bytes", "who")

    def __init__(self, path: str, fd: int, who: dict) -> None:
        self.path, self.fd, self.bytes, self.who = path, fd, 0, who


def generation(path: str):
    """What identifies an object's generation here: (inode, mtime, size), or None if absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size) if statmod.S_ISREG(st.st_mode) else None


class Handles:
    """The mount's file handles (``fh`` -> :class:`Writer` or :class:`Reader`) and local copies.

    ``mu`` (reentrant) guards the table and every writer's state; the FUSE operations hold it
    while they read or change them.

    :param staging: folder of the local copies (on the file system of the bucket folder, so that
        an upload is a rename).
    """

    def __init__(self, staging: str) -> None:
        self.staging = staging
        self.mu = threading.RLock()
        self.table: dict = {}
        self.next_fh = 1
        self.counter = 0

    def add(self, handle) -> int:
        """Register ``handle``; returns its new ``fh``."""
        with self.mu:
            fh = self.next_fh
            self.next_fh += 1
            self.table[fh] = handle
            return fh

    def writers_of(self, path: str) -> list:
        """Writers of ``path`` on any task's mount not uploaded by a close and not deleted."""
        return [h for h in self.table.values() if isinstance(h, Writer) and h.path == path
                and not h.finalized and not h.unlinked]

    def mine(self, path: str, who: dict) -> list:
        """:meth:`writers_of` ``path`` on the mount of ``who``'s task (see :func:`~.gcsfuse_events.task_of`)."""
        task = task_of(who)
        return [w for w in self.writers_of(path) if task_of(w.who) == task]

    def open_of(self, path: str, who: dict) -> list:
        """Every writer of ``path`` ``who``'s task has open, also one a close has uploaded
        while another handle keeps it open (gcsfuse's inode of that mount)."""
        task = task_of(who)
        return [h for h in self.table.values() if isinstance(h, Writer) and h.path == path
                and not h.unlinked and task_of(h.who) == task]

    def streaming_now(self, who: dict) -> int:
        """Files streaming now on the mount ``who`` writes through: on Cloud Run each task
        has its own mount, so on the emulator's shared mount the files of ``who``'s task
        (execution, task index, attempt); writers without a task share one count."""
        task = task_of(who)
        return sum(1 for h in self.table.values() if isinstance(h, Writer) and h.mode == "stream"
                   and not h.finalized and task_of(h.who) == task)

    def writers_under(self, path: str) -> list:
        """Writers not deleted of files below folder ``path``."""
        prefix = path.rstrip("/") + "/"
        return [h for h in self.table.values() if isinstance(h, Writer) and not h.unlinked
                and h.path.startswith(prefix)]

    def writers_with_base(self, path: str, base) -> list:
        """Every writer of ``path`` whose object generation is ``base``."""
        return [h for h in self.table.values() if isinstance(h, Writer) and h.path == path and h.base == base]

    def temp(self) -> tuple:
        """A new, empty local copy: ``(path, fd)`` (read and write, mode 0600)."""
        with self.mu:
            self.counter += 1
            name = os.path.join(self.staging, f"{os.getpid()}-{self.counter}")
        return name, os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)

    def drop(self, w: Writer) -> None:
        """Delete ``w``'s local copy (if it still has one)."""
        if w.temp is not None:
            try:
                os.unlink(w.temp)
            except FileNotFoundError:
                pass
            w.temp = None

    def private_copy(self, w: Writer) -> None:
        """After a close published ``w``'s local copy itself (a streaming file), give ``w`` a
        copy of those bytes to go on with."""
        if w.temp is None:
            temp, fd = self.temp()
            size = os.fstat(w.fd).st_size
            os.sendfile(fd, w.fd, 0, size) if size else None
            os.close(w.fd)
            w.fd, w.temp = fd, temp
