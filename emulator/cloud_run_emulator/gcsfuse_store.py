"""The bucket folder behind a FUSE mount, as Cloud Storage would see it: an object appears whole
(a rename into the folder), a download copies it whole, a rename is a copy then a delete of every
object (gcsfuse's ``docs/semantics.md``, "Rename": not atomic), and each object name's last write
is remembered for the rewrite-rate record.

Imported by the mount process only (:mod:`.gcsfuse_process`); errors are ``mfusepy.FuseOSError``
(an ``OSError`` whose ``errno`` the FUSE operation returns).
"""

from __future__ import annotations

import errno
import os
import shutil
import time

from mfusepy import FuseOSError

from .gcsfuse_events import EventLog
from .gcsfuse_handles import Handles, Writer, generation
from .gcsfuse_rules import rename_dir_refusal, throttled


class ObjectStore:
    """The folder of objects (a bucket folder, or the storage root of all buckets).

    :param root: the folder; a mount path ``/a/b`` is ``{root}/a/b``.
    :param handles: the mount's handles (their local copies are the staging files used here).
    :param log: where records go.
    """

    def __init__(self, root: str, handles: Handles, log: EventLog) -> None:
        self.root = root.rstrip("/")
        self.handles = handles
        self.log = log
        self.last_write: dict = {}  # mount path -> monotonic time of its last write

    def real(self, path: str) -> str:
        """The folder's path of mount path ``path``."""
        return self.root + path

    def note_rewrite(self, path: str, who: dict, now: float) -> None:
        """Record ``throttled-rewrite`` when ``path`` was last written (``last_write``, which the
        caller sets once written) less than :data:`~.gcsfuse_rules.REWRITE_INTERVAL_S` before
        ``now`` (monotonic s)."""
        last = self.last_write.get(path)
        if throttled(last, now):
            self.log.record("throttled-rewrite", path, who, seconds=round(now - last, 3))

    def fetch(self, w: Writer) -> None:
        """Download the object ``w`` opened into ``w``'s local copy (the whole object, counted
        as read by ``w``); nothing when it is gone."""
        src = generation(self.real(w.path))
        if src is not None:
            with open(self.real(w.path), "rb") as f:
                os.ftruncate(w.fd, 0)
                os.sendfile(w.fd, f.fileno(), 0, src[2]) if src[2] else None
            w.reads += src[2]  # a download of the whole object

    def publish(self, w: Writer, size: int, copy: bool) -> None:
        """Make ``w``'s local copy the object: with ``copy`` its first ``size`` bytes are copied
        (with its times) and renamed into place, and ``w`` keeps its local copy; else the local
        copy itself is renamed into place."""
        real = self.real(w.path)
        os.makedirs(os.path.dirname(real), exist_ok=True)
        if copy:
            tmp, fd = self.handles.temp()
            try:
                os.sendfile(fd, w.fd, 0, size) if size else None
                local = os.fstat(w.fd)  # the object's time is its local copy's (utimens)
                os.utime(fd, ns=(local.st_atime_ns, local.st_mtime_ns))
            finally:
                os.close(fd)
            os.rename(tmp, real)
        else:
            os.rename(w.temp, real)
            w.temp = None

    def copy_object(self, real_old: str, real_new: str) -> None:
        """The copy of a rename: the new name appears while the old one still exists."""
        tmp, fd = self.handles.temp()
        os.close(fd)
        os.unlink(tmp)
        os.makedirs(os.path.dirname(real_new), exist_ok=True)
        try:
            os.link(real_old, tmp)  # same bytes without copying them
        except OSError:
            shutil.copyfile(real_old, tmp)
        os.rename(tmp, real_new)

    def move_object(self, old: str, new: str) -> int:
        """Rename object ``old`` to ``new`` (mount paths): a copy, then a delete.

        :returns: its size in bytes.
        :raises FuseOSError: ``ENOENT`` when ``old`` is gone, ``EISDIR`` when ``new`` is a folder.
        """
        real_old, real_new = self.real(old), self.real(new)
        if not os.path.exists(real_old):
            raise FuseOSError(errno.ENOENT)
        if os.path.isdir(real_new):
            raise FuseOSError(errno.EISDIR)
        size = os.path.getsize(real_old)
        self.copy_object(real_old, real_new)
        os.unlink(real_old)
        return size

    def local_files_under(self, path: str) -> list:
        """Files below folder ``path`` being written that are no object yet (gcsfuse's
        local files: a folder holding one cannot be removed or renamed)."""
        with self.handles.mu:
            return [w.path for w in self.handles.writers_under(path) if not w.opened_existing
                    and not os.path.exists(self.real(w.path))]

    def move_folder(self, old: str, new: str, who: dict, limit: int) -> None:
        """Rename folder ``old`` to ``new``: a copy and delete of every object below it.

        :param limit: the mount's ``rename-dir-limit``.
        :raises FuseOSError: ``ENOTSUP`` while a file in it is not uploaded, ``EMFILE`` (also
            recorded) when it holds more objects than ``limit``, ``ENOTEMPTY`` when ``new`` is a
            folder that is not empty.
        """
        real_old, real_new = self.real(old), self.real(new)
        if self.local_files_under(old):
            raise FuseOSError(errno.ENOTSUP)
        walked = list(os.walk(real_old))
        files = [os.path.join(d, f) for d, _, fs in walked for f in fs]
        objects = len(files) + sum(len(ds) for _, ds, _ in walked)  # a folder is an object too
        refusal = rename_dir_refusal(objects, limit)
        if refusal:
            self.log.record("non-atomic-rename", old, who, to=new.lstrip("/"), directory=True, refused=refusal)
            raise FuseOSError(errno.EMFILE)
        if os.path.exists(real_new) and os.listdir(real_new):
            raise FuseOSError(errno.ENOTEMPTY)
        os.makedirs(real_new, exist_ok=True)
        total = 0
        for f in files:
            target = os.path.join(real_new, os.path.relpath(f, real_old))
            total += os.path.getsize(f)
            self.copy_object(f, target)
            os.unlink(f)
        shutil.rmtree(real_old, ignore_errors=True)
        self.log.record("non-atomic-rename", old, who, to=new.lstrip("/"), directory=True, bytes=total,
                        objects=len(files))

    def truncate_object(self, path: str, length: int, size: int, who: dict) -> None:
        """Rewrite object ``path`` of ``size`` bytes cut or extended to ``length`` bytes (a new
        object through a staging file, recorded as ``staged`` with cause ``truncate``)."""
        real = self.real(path)
        tmp, fd = self.handles.temp()
        try:
            with open(real, "rb") as f:
                keep = min(length, size)
                os.sendfile(fd, f.fileno(), 0, keep) if keep else None
            os.ftruncate(fd, length)
        finally:
            os.close(fd)
        self.log.record("staged", path, who, cause="truncate", bytes=length)
        os.rename(tmp, real)
        with self.handles.mu:
            self.last_write[path] = time.monotonic()
