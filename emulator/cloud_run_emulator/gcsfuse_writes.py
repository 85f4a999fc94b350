"""How a file open for writing on the FUSE volume becomes an object (gcsfuse's ``docs/semantics.md``,
"Streaming Writes" and "Staged Writes"): a new file written in order streams and is uploaded at
close; anything else falls back to a staged write (a full local copy, uploaded at close and at
``fsync``), or fails with ``EIO`` in strict mode; a writer whose object changed since it opened it
gets ``ESTALE`` at close.

The rules are the pure functions of :mod:`.gcsfuse_rules`; the states are the writers of
:mod:`.gcsfuse_handles`; the uploads and downloads are :mod:`.gcsfuse_store`'s. Imported by the
mount process only (:mod:`.gcsfuse_process`). The FUSE operations call these methods with
``handles.mu`` held, but :meth:`Writes.open_existing` (a writer no other thread sees yet).
"""

from __future__ import annotations

import errno
import os
import time

from mfusepy import FuseOSError

from .gcsfuse_events import EventLog
from .gcsfuse_handles import Handles, Writer, generation
from .gcsfuse_rules import (
    MountSettings, after_upload_cause, overwrites, stream_refusal, truncation_stages, uploads_at_close,
)
from .gcsfuse_store import ObjectStore


class Writes:
    """The writers' state changes: which write streams, which is staged, and the uploads.

    :param settings: the mount's settings (strict mode, streaming, its limit).
    :param handles: the mount's handles.
    :param store: the bucket folder.
    :param log: where records go.
    """

    def __init__(self, settings: MountSettings, handles: Handles, store: ObjectStore, log: EventLog) -> None:
        self.settings = settings
        self.handles = handles
        self.store = store
        self.log = log

    def refuse(self, path: str, who: dict, cause: str) -> None:
        """Strict mode: record the staged write refused and fail it.

        :raises FuseOSError: ``EIO``, always.
        """
        self.log.record("staged", path, who, cause=cause, bytes=0, refused="EIO (strict mode)")
        raise FuseOSError(errno.EIO)

    def stage(self, w: Writer, cause: str, fetch: bool = True) -> None:
        """Fall back to a staged write for ``w`` (or EIO in strict mode); ``fetch``: an
        existing object's bytes are copied into the local copy first (not for a truncation
        on open, which starts from empty)."""
        if self.settings.strict:
            self.refuse(w.path, w.who, cause)
        if fetch and w.opened_existing and not w.dirty and w.mode is None:
            self.store.fetch(w)  # the local copy of an existing object: the whole object first
        w.mode, w.cause = "staged", cause

    def begin_stream(self, w: Writer, offset: int) -> None:
        """The first write of a file that may stream: it streams unless streaming is off,
        the task streams as many files as it may, or the write is not at offset 0."""
        settings = self.settings
        cause = stream_refusal(settings.streaming, self.handles.streaming_now(w.who), settings.stream_limit, offset)
        if cause is not None:
            self.stage(w, cause)
        else:
            w.mode, w.cause, w.next_offset = "stream", None, 0

    def finalize(self, w: Writer, keep: bool = False) -> None:
        """Upload ``w``'s local copy as the object (a rename into the bucket folder); with
        ``keep`` (and always for a staged file, which may be written on after ``fsync``)
        a copy is published and the local copy stays ``w``'s.

        :raises FuseOSError: ``ESTALE`` when the object changed since ``w`` opened it."""
        if w.unlinked:  # its task deleted it: nothing is uploaded
            return
        real = self.store.real(w.path)
        if generation(real) != w.base:
            self.log.record("estale", w.path, w.who, cause="the object changed since it was opened")
            w.finalized = True
            self.handles.drop(w)
            raise FuseOSError(errno.ESTALE)
        size = os.fstat(w.fd).st_size
        now = time.monotonic()
        self.store.note_rewrite(w.path, w.who, now)
        if w.mode == "staged":
            self.log.record("staged", w.path, w.who, cause=w.cause, bytes=size)
        self.store.publish(w, size, copy=keep or w.mode == "staged")
        self.store.last_write[w.path] = now
        w.base = generation(real)
        w.dirty = False

    def read_while_writing(self, w: Writer) -> None:
        """A read of a file still streaming (or not written yet): it is uploaded, then staged."""
        if self.settings.strict:
            self.refuse(w.path, w.who, "read-while-writing")
        if w.mode is None:
            w.mode = "stream"
        self.finalize(w, keep=True)
        w.mode, w.cause = "staged", "read-while-writing"

    def truncate(self, w: Writer, length: int) -> None:
        """Cut or extend the file ``w`` writes to ``length`` bytes (see
        :func:`~.gcsfuse_rules.truncation_stages`); a file a close uploaded is a staged rewrite."""
        size = os.fstat(w.fd).st_size if w.local else (w.base[2] if w.base else 0)
        if length == size:
            return
        if w.finalized:  # uploaded by a close of another handle: a staged rewrite, uploaded at close
            self.handles.private_copy(w)
            self.stage(w, "truncate", fetch=False)
            w.finalized = False
        elif truncation_stages(w.mode, w.opened_existing, size, length):
            self.stage(w, "truncate")  # the object's bytes first, then cut or extended
        os.ftruncate(w.fd, length)
        w.dirty = True
        w.next_offset = min(w.next_offset, length)  # a stream goes on where its bytes end

    def before_write(self, w: Writer, offset: int) -> None:
        """Whatever a write at ``offset`` changes before its bytes land: it starts a stream,
        stages the file (overwrite, out of order, after an upload) or goes on as it is."""
        if w.finalized:  # uploaded by a close of one of its handles, or by a rename
            self.handles.private_copy(w)
            if os.fstat(w.fd).st_size == 0:  # an empty object streams again (gcsfuse)
                self.begin_stream(w, offset)
            else:
                self.stage(w, after_upload_cause(w.cause), fetch=False)
            w.finalized = False  # only now: a refused write (strict) leaves the file as it was
        elif w.mode is None:
            if overwrites(w.opened_existing, w.base[2] if w.base is not None else None):
                self.stage(w, "overwrite")
            else:  # a new file, or an existing empty object (gcsfuse streams both)
                self.begin_stream(w, offset)
        elif w.mode == "stream" and offset != w.next_offset:
            self.stage(w, "out-of-order-write")
        w.dirty = True

    def close(self, w: Writer) -> None:
        """A close (``flush``) of a writer not uploaded yet: upload it where
        :func:`~.gcsfuse_rules.uploads_at_close` says so (a new file never written is an empty
        stream); it counts as uploaded either way, also when the upload fails."""
        if not uploads_at_close(w.mode, w.opened_existing, w.dirty, w.unlinked):
            w.finalized = True
            return
        if w.mode is None:
            w.mode = "stream"
        mode = w.mode
        try:
            self.finalize(w)
        finally:
            w.finalized = True
            w.mode = mode

    def open_existing(self, path: str, who: dict, truncate: bool) -> Writer:
        """A writer of existing object ``path`` for ``who``; ``truncate`` (``O_TRUNC``) of a
        non-empty object is a staged rewrite of it from empty.

        :raises FuseOSError: ``EIO`` for that rewrite in strict mode (nothing is left open).
        """
        temp, fd = self.handles.temp()
        w = Writer(path, fd, temp, generation(self.store.real(path)), who, opened_existing=True)
        if truncate and w.base is not None and w.base[2] > 0:
            try:
                self.stage(w, "truncate", fetch=False)
            except FuseOSError:
                os.close(fd)
                self.handles.drop(w)
                raise
            w.dirty = True
        return w
