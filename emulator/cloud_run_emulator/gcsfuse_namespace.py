"""The FUSE volume's names: listing, folders, deletes, times and renames (gcsfuse's
``docs/semantics.md``, "Rename" and "Files and directories": a rename is a copy then a delete, a
folder rename moves at most ``rename-dir-limit`` objects, a file not uploaded yet keeps its
folder from being removed or renamed, a time change is metadata, not a new generation).

A part of :class:`~.gcsfuse_ops.GcsFuseOperations`, which provides ``settings``, ``handles``,
``store``, ``writes``, ``log`` and ``_who``. Imported by the mount process only
(:mod:`.gcsfuse_process`).
"""

from __future__ import annotations

import errno
import os
import time

from mfusepy import FuseOSError

from .gcsfuse_events import task_of
from .gcsfuse_handles import generation
from .gcsfuse_rules import AFTER_RENAME, resolve_times


class NamespaceOperations:
    """The FUSE operations on names (mixed into :class:`~.gcsfuse_ops.GcsFuseOperations`)."""

    def _top(self, path: str) -> None:
        """Nothing but buckets at the top of a buckets-root mount (``EACCES``)."""
        if self.settings.buckets_root and path.count("/") <= 1:
            raise FuseOSError(errno.EACCES)

    def readdir(self, path, fh):
        """The folder's entries, plus the caller's task's files below it not uploaded yet
        (another task's mount shows none of them)."""
        real = self.store.real(path)
        try:
            names = [e.name for e in os.scandir(real) if not e.is_symlink()]
        except FileNotFoundError:
            raise FuseOSError(errno.ENOENT) from None
        prefix = path.rstrip("/") + "/"
        with self.handles.mu:
            pending = [h for h in self.handles.writers_under(path) if not h.finalized]
            if pending:
                task = task_of(self._who())
                for h in pending:
                    rest = h.path[len(prefix):]
                    if task_of(h.who) == task and "/" not in rest and rest not in names:
                        names.append(rest)
        return [".", ".."] + names

    def statfs(self, path):
        """The bucket folder's file system."""
        sv = os.statvfs(self.store.root)
        return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                           "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

    def mkdir(self, path, mode):
        """A folder (``EEXIST``, ``ENOENT`` as ``mkdir``)."""
        self._top(path)
        try:
            os.mkdir(self.store.real(path))
        except FileExistsError:
            raise FuseOSError(errno.EEXIST) from None
        except FileNotFoundError:
            raise FuseOSError(errno.ENOENT) from None

    def rmdir(self, path):
        """Remove a folder; ``ENOTEMPTY`` also while a file in it is not uploaded."""
        self._top(path)
        if self.store.local_files_under(path):
            raise FuseOSError(errno.ENOTEMPTY)
        try:
            os.rmdir(self.store.real(path))
        except OSError as exc:
            raise FuseOSError(exc.errno) from None

    def unlink(self, path):
        """Delete the object: the caller's task's writers of it upload nothing now; another
        task's get ``ESTALE`` at close."""
        with self.handles.mu:
            pending = self.handles.open_of(path, self._who())
            for w in pending:
                w.unlinked = True
        try:
            os.unlink(self.store.real(path))
        except FileNotFoundError:
            if not pending:
                raise FuseOSError(errno.ENOENT) from None
        except IsADirectoryError:
            raise FuseOSError(errno.EISDIR) from None

    def chmod(self, path, mode):
        """Accepted, changes nothing (modes are the mount's)."""
        return 0

    def chown(self, path, uid, gid):
        """Accepted, changes nothing (the owner is the mount's)."""
        return 0

    def utimens(self, path, times=None):
        """Set the object's modification time (gcsfuse keeps it in the object's metadata: a
        metadata update, not a new generation, so open writers keep their base)."""
        if path is None:
            return 0
        real = self.store.real(path)
        with self.handles.mu:
            local = [w for w in self.handles.writers_of(path) if w.local]  # uploaded with it at close
            before = generation(real)
            if before is None and not local:
                raise FuseOSError(errno.ENOENT)
            st = os.fstat(local[-1].fd) if local else os.stat(real)
            ns = resolve_times(times, (st.st_atime_ns, st.st_mtime_ns), time.time_ns())
            for w in local:
                os.utime(w.fd, ns=ns)
            if before is not None:
                os.utime(real, ns=ns)
            after = generation(real)
            for h in self.handles.writers_with_base(path, before):
                h.base = after
        return 0

    def rename(self, old, new):
        """Rename a file (a copy, then a delete: both names exist for a moment) or a folder (see
        :meth:`~.gcsfuse_store.ObjectStore.move_folder`); recorded as ``non-atomic-rename``.
        The caller's task's file still being written is uploaded first and its writer goes on
        with the new name; another task's writer of the old name gets ``ESTALE`` at close."""
        self._top(old)
        self._top(new)
        who = self._who()
        with self.handles.mu:
            moved = self.handles.mine(old, who)
            for w in moved:
                if w.local:
                    self.writes.finalize(w, keep=True)
            before = generation(self.store.real(old))
        if os.path.isdir(self.store.real(old)):
            self.store.move_folder(old, new, who, self.settings.rename_dir_limit)
            return 0
        size = self.store.move_object(old, new)
        with self.handles.mu:
            now = time.monotonic()
            self.store.note_rewrite(new, who, now)  # the copy writes that name
            self.store.last_write[new] = now
            self._renamed(moved, new, before, generation(self.store.real(new)))
        self.log.record("non-atomic-rename", old, who, to=new.lstrip("/"), bytes=size)
        return 0

    @staticmethod
    def _renamed(moved: list, new: str, before, after) -> None:
        """The writers of a renamed file write the renamed object: a write of one whose file
        was uploaded is a staged rewrite of it; another keeps following the object."""
        for w in moved:
            if w.local:
                w.finalized, w.cause, w.dirty, w.base = True, AFTER_RENAME, False, after
            elif w.base == before:
                w.base = after
            w.path = new
