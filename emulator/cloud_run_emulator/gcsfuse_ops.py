"""The FUSE volume's file system: the operations libfuse calls (through ``mfusepy``), each a thin
adapter over the mount's handles (:mod:`.gcsfuse_handles`), its writers' rules
(:mod:`.gcsfuse_writes`, :mod:`.gcsfuse_rules`) and its bucket folder (:mod:`.gcsfuse_store`).

The semantics are gcsfuse's ``docs/semantics.md`` as the module docstring of :mod:`.gcsfuse`
lists them. Imported by the mount process only (:mod:`.gcsfuse_process`): importing ``mfusepy``
loads libfuse, which the emulator itself never needs.
"""

from __future__ import annotations

import errno
import os
import stat as statmod

import mfusepy
from mfusepy import FuseOSError

from .gcsfuse_events import EventLog, identity
from .gcsfuse_handles import Handles, Reader, Writer, generation
from .gcsfuse_namespace import NamespaceOperations
from .gcsfuse_rules import MountSettings, attributes
from .gcsfuse_store import ObjectStore
from .gcsfuse_writes import Writes


class GcsFuseOperations(NamespaceOperations, mfusepy.Operations):
    """The mount's file system: files (this class) and names (:class:`~.gcsfuse_namespace.NamespaceOperations`).

    Paths are the mount's (``/name``, ``/bucket/name`` on a mount of all buckets); an error is a
    ``FuseOSError`` whose ``errno`` the operation returns.

    :param source: the folder of objects.
    :param state_dir: folder of ``staging/`` (made by the caller) and ``events.jsonl``.
    :param settings: the mount's settings (:meth:`~.gcsfuse_rules.MountSettings.from_options`).
    :raises OSError: when ``events.jsonl`` cannot be opened.
    """

    use_ns = True

    def __init__(self, source: str, state_dir: str, settings: MountSettings) -> None:
        self.settings = settings
        self.log = EventLog(os.path.join(state_dir, "events.jsonl"), settings.buckets_root)
        self.handles = Handles(os.path.join(state_dir, "staging"))
        self.store = ObjectStore(source, self.handles, self.log)
        self.writes = Writes(settings, self.handles, self.store, self.log)

    def _who(self) -> dict:
        """The calling process's identity (see :func:`~.gcsfuse_events.identity`)."""
        return identity(mfusepy.fuse_get_context()[2])

    def init_with_config(self, conn_info, config_3):
        """1 MiB reads and writes, attributes cached 1 s, no negative cache, ``hard_remove``."""
        if conn_info is not None:
            conn_info.max_write = 1 << 20
            conn_info.max_readahead = 1 << 20
        if config_3 is not None:
            config_3.attr_timeout = 1.0
            config_3.entry_timeout = 1.0
            config_3.negative_timeout = 0.0
            # an unlinked open file is gone at once (gcsfuse deletes the object), not renamed to
            # a .fuse_hidden* object by libfuse; its handle's reads, writes and close come without
            # a path (libfuse's high-level API then answers fstat of it with ESTALE)
            config_3.hard_remove = 1

    def getattr(self, path, fh=None):
        """The attributes of an open file's local copy, of what a task writing ``path`` wrote,
        else of the object or folder (symbolic links do not exist)."""
        with self.handles.mu:
            h = self.handles.table.get(fh) if fh is not None else None
            if isinstance(h, Writer) and h.local or h is not None and path is None:
                return attributes(os.fstat(h.fd), self.settings)  # fstat of an open file (also unlinked)
            if path is None:
                raise FuseOSError(errno.ENOENT)
            shown = [w for w in self.handles.writers_of(path) if w.local]
            if shown:  # what this file is to its task: the local copy, size as written
                shown = [w for w in self.handles.mine(path, self._who()) if w.local]
            if shown:
                return attributes(os.fstat(shown[-1].fd), self.settings)
        try:
            st = os.lstat(self.store.real(path))
        except FileNotFoundError:
            raise FuseOSError(errno.ENOENT) from None
        if statmod.S_ISLNK(st.st_mode):
            raise FuseOSError(errno.ENOENT)
        return attributes(st, self.settings)

    def truncate(self, path, length, fh=None):
        """Cut or extend a file being written (see :meth:`~.gcsfuse_writes.Writes.truncate`), or
        rewrite an object cut or extended (a staged write; ``EIO`` in strict mode)."""
        with self.handles.mu:
            w = self.handles.table.get(fh) if fh is not None else None
            if not isinstance(w, Writer) and path is not None:
                writers = self.handles.mine(path, self._who())
                w = writers[-1] if writers else None
            if isinstance(w, Writer):
                self.writes.truncate(w, length)
                return 0
        if path is None:
            raise FuseOSError(errno.EBADF)
        current = generation(self.store.real(path))
        if current is None:
            raise FuseOSError(errno.ENOENT)
        if current[2] == length:
            return 0
        who = self._who()
        if self.settings.strict:
            self.writes.refuse(path, who, "truncate")
        self.store.truncate_object(path, length, current[2], who)
        return 0

    def create(self, path, mode, fi=None):
        """A new file: a writer with an empty local copy (no object until it is closed)."""
        self._top(path)
        real = self.store.real(path)
        if not os.path.isdir(os.path.dirname(real)):
            raise FuseOSError(errno.ENOENT)
        temp, fd = self.handles.temp()
        return self.handles.add(Writer(path, fd, temp, generation(real), self._who(), opened_existing=False))

    def open(self, path, flags):
        """Open for reading (the object, or the task's staged local copy; a file the task still
        streams is uploaded and staged first) or for writing (see :meth:`_open_for_write`)."""
        who = self._who()
        if flags & os.O_ACCMODE != os.O_RDONLY:
            return self._open_for_write(path, flags, who)
        with self.handles.mu:
            for w in [w for w in self.handles.mine(path, who) if w.local]:
                if w.mode in (None, "stream"):  # reading a file still streaming: finalized, then staged
                    self.writes.read_while_writing(w)
            writers = [w for w in self.handles.mine(path, who) if w.local]
            if writers:  # a staged local copy is what this mount shows
                fd = os.open(writers[-1].temp, os.O_RDONLY)
                return self.handles.add(Reader(path, fd, who))
        try:
            fd = os.open(self.store.real(path), os.O_RDONLY)
        except FileNotFoundError:
            raise FuseOSError(errno.ENOENT) from None
        return self.handles.add(Reader(path, fd, who))

    def _open_for_write(self, path: str, flags: int, who: dict) -> int:
        """The task's writer of ``path`` not uploaded yet (one inode, one local copy), a new
        file where only another task writes ``path``, or a writer of the existing object."""
        real = self.store.real(path)
        with self.handles.mu:
            # One a close has uploaded is the object now: a new open of it is an open of that
            # object (the kernel's release of the closed handle comes later, asynchronously,
            # so the closed handle may still be here; joining it made the next write a
            # write-after-close instead of an overwrite, depending on that timing).
            mine = [w for w in self.handles.open_of(path, who) if not w.finalized]
            if mine:
                w = mine[-1]
                if flags & os.O_TRUNC:
                    self.writes.truncate(w, 0)
                w.refs += 1
                return self.handles.add(w)
            others = self.handles.writers_of(path)
        if others and not os.path.exists(real):
            # another task's file not uploaded yet: a new file on this task's mount
            temp, fd = self.handles.temp()
            return self.handles.add(Writer(path, fd, temp, None, who, opened_existing=False))
        if not os.path.exists(real):
            raise FuseOSError(errno.ENOENT)
        return self.handles.add(self.writes.open_existing(path, who, truncate=bool(flags & os.O_TRUNC)))

    def read(self, path, size, offset, fh):
        """Bytes of an open file: a reader's (counted), an existing object a writer has not
        changed (read from the bucket, counted), else the writer's local copy (a file still
        streaming is uploaded and staged first)."""
        h = self.handles.table[fh]
        if isinstance(h, Writer):
            with self.handles.mu:
                if not h.local:  # an existing object opened for writing, nothing written
                    try:
                        with open(self.store.real(h.path), "rb") as f:
                            data = os.pread(f.fileno(), size, offset)
                    except FileNotFoundError:
                        return b""
                    h.reads += len(data)  # read from the bucket, like a reading handle's
                    return data
                if h.mode in (None, "stream") and not h.finalized:
                    self.writes.read_while_writing(h)
            return os.pread(h.fd, size, offset)
        data = os.pread(h.fd, size, offset)
        h.bytes += len(data)
        return data

    def read_into(self, fh, buf, size, offset) -> int:
        """:meth:`read` into the kernel's buffer ``buf`` (no copy for a reader); returns the count."""
        h = self.handles.table[fh]
        if isinstance(h, Writer):
            data = self.read(None, size, offset, fh)
            buf[:len(data)] = data
            return len(data)
        got = os.preadv(h.fd, [buf], offset)
        h.bytes += got
        return got

    def write(self, path, data, offset, fh):
        """Write to a writer's local copy, after what the write changes (see
        :meth:`~.gcsfuse_writes.Writes.before_write`); ``EBADF`` for a reader."""
        w = self.handles.table[fh]
        if not isinstance(w, Writer):
            raise FuseOSError(errno.EBADF)
        with self.handles.mu:
            self.writes.before_write(w, offset)
        written = os.pwrite(w.fd, data, offset)
        if offset + written > w.next_offset:
            w.next_offset = offset + written
        return written

    def write_from(self, fh, buf, offset) -> int:
        """:meth:`write` from the kernel's buffer ``buf``."""
        return self.write(None, buf, offset, fh)

    def fsync(self, path, datasync, fh):
        """A staged file is uploaded; a streaming file is not finalized."""
        h = self.handles.table.get(fh)
        if isinstance(h, Writer) and h.mode == "staged" and h.dirty and not h.finalized:
            with self.handles.mu:
                self.writes.finalize(h)
        return 0

    def flush(self, path, fh):
        """A close: a writer is uploaded (see :meth:`~.gcsfuse_writes.Writes.close`); the bytes
        a handle read or downloaded are recorded (release comes later, asynchronously)."""
        h = self.handles.table.get(fh)
        if isinstance(h, Reader):
            if h.bytes:
                self.log.record("read", h.path, h.who, bytes=h.bytes)
                h.bytes = 0
            return 0
        if isinstance(h, Writer) and h.reads:  # what the handle downloaded (reads, a staged fetch)
            self.log.record("read", h.path, h.who, bytes=h.reads)
            h.reads = 0
        if not isinstance(h, Writer) or h.finalized:
            return 0
        with self.handles.mu:
            self.writes.close(h)
        return 0

    def release(self, path, fh):
        """Forget a handle: a reader's descriptor is closed (its bytes recorded), a writer's
        local copy is deleted when the task's last handle of it goes."""
        with self.handles.mu:
            h = self.handles.table.pop(fh, None)
        if h is None:
            return 0
        if isinstance(h, Reader):
            if h.bytes:
                self.log.record("read", h.path, h.who, bytes=h.bytes)
            os.close(h.fd)
            return 0
        with self.handles.mu:
            h.refs -= 1
            if h.refs > 0:  # another handle of the task still has the file open
                return 0
        os.close(h.fd)
        self.handles.drop(h)
        return 0
