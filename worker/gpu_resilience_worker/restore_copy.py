"""The restore's private local copy of a checkpoint's bytes, verified while it is filled.

:class:`LocalCopy` reads a checkpoint once (the Cloud Storage FUSE rule: a restore reads a
checkpoint's bytes once), hashing each chunk on the threads of :mod:`gpu_resilience_worker.fastio`
as it arrives, into memory that ``torch.load(..., mmap=True)`` maps without another copy.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from typing import BinaryIO, Callable

from gpu_resilience_worker.fastio import DIGEST_CHUNK, ChunkHasher, read_pipelined


class LocalCopy:
    """A private local copy of a file's bytes that ``torch.load(..., mmap=True)`` can map.

    On Linux it is an anonymous memory file (``memfd_create``), opened by path through
    ``/proc/self/fd``; elsewhere an unnamed-after-use temporary file. Its pages are the one copy of
    a checkpoint a restore holds: tensors loaded with ``mmap=True`` share them, and they are freed
    when both the copy is closed and those tensors are gone (a mapping outlives its file).

    Where no such file can be made at that size (a file size limit, a full temporary folder),
    the copy is anonymous memory instead: ``path`` is then ``None`` and ``buffer`` holds
    the bytes (loading it costs one more copy of the state while it is deserialized).

    :param size: bytes of the copy.
    :raises ValueError: for a negative size.
    :raises OSError: when not even anonymous memory of that size can be had.
    """

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size!r}")
        self.size = size
        self._temp: str | None = None
        self._fd = -1
        self.path: str | None = None
        self.buffer: mmap.mmap | None = None
        try:
            if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
                self._fd = os.memfd_create("checkpoint-copy", os.MFD_CLOEXEC)
                self.path = f"/proc/self/fd/{self._fd}"
            else:
                self._fd, self._temp = tempfile.mkstemp(prefix="checkpoint-copy-")
                self.path = self._temp
            os.ftruncate(self._fd, size)
        except OSError:
            self.close()
            self.path = None
            self.buffer = mmap.mmap(-1, max(size, 1))

    @property
    def in_memory(self) -> bool:
        """Whether ``path`` names memory of this process only (a ``memfd``), not a file."""
        return self.path is not None and self._temp is None

    def fill(self, handle: BinaryIO, chunk_bytes: int = DIGEST_CHUNK, digest: str = "sha256",
             stop: Callable[[], bool] | None = None) -> tuple[int, list[str]]:
        """Read ``handle`` into the copy in one sequential pass, hashing each piece as it lands.

        :param handle: an unbuffered binary file opened for reading, at its start.
        :param chunk_bytes: bytes per digest; default :data:`DIGEST_CHUNK`.
        :param digest: one of :data:`DIGESTS`; default ``sha256``.
        :param stop: asked before each :data:`CHUNK` read; when it returns true the fill ends
            with :class:`InterruptedError` (a SIGTERM during a restore); default never.
        :return: ``(bytes read, hex digest per chunk)``; the bytes read stop at ``size``, and
            one byte more counts (so a file longer than expected does not match).
        :raises OSError: when reading fails; :class:`InterruptedError` (an ``OSError``) when
            ``stop`` said so.
        """
        hasher = ChunkHasher(chunk_bytes, digest)
        if self.size == 0:
            return len(handle.read(1) or b""), []
        position = read_pipelined(handle, lambda view, offset: self._absorb(hasher, view, offset), self.size, stop)
        extra = len(handle.read(1) or b"") if position == self.size else 0
        return position + extra, hasher.digests()

    def _absorb(self, hasher: ChunkHasher, view: memoryview, offset: int) -> None:
        """Put a piece into the copy, then hash it (in that order it kept up with a cold read):
        with ``pwrite`` into the file (no page fault or zero-fill per page, as a write through a
        mapping of new pages costs), or into the anonymous memory."""
        if self.buffer is not None:
            self.buffer[offset : offset + view.nbytes] = view
        else:
            piece, position = view, offset
            while piece.nbytes:
                written = os.pwrite(self._fd, piece, position)
                piece, position = piece[written:], position + written
        hasher.update(view)

    def close(self) -> None:
        """Close (and, for a temporary file, delete) the copy; mappings of it stay valid."""
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._temp is not None:
            try:
                os.remove(self._temp)
            except OSError:
                pass
            self._temp = None

    def __enter__(self) -> LocalCopy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
