"""Storage behind a small protocol on ``str`` paths, implemented for a local (or FUSE-mounted) file system.
Nothing here assumes that rename is atomic (on a GCS FUSE mount it is a copy, then a delete): readers validate
what they read (see :mod:`gpu_resilience_worker.checkpoint`)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import BinaryIO, Callable, Protocol, Union

from gpu_resilience_worker import fastio, forkguard

#: What :meth:`Storage.write` takes: the bytes, or a function that writes them into an unbuffered binary
#: file (so big checkpoints stream to storage without an in-memory copy).
Payload = Union[bytes, Callable[[BinaryIO], None]]


class Storage(Protocol):
    """What the checkpoint manager needs from a storage backend."""

    def write(self, path: str, data: Payload, *, atomic: bool = False) -> None:
        """Write ``data`` durably to ``path``, creating parent folders."""

    def read(self, path: str) -> bytes:
        """:return: the whole content of ``path``; raises ``OSError`` when unreadable."""

    def open_read(self, path: str) -> BinaryIO:
        """:return: ``path`` opened for unbuffered binary reading; raises ``OSError``."""

    def size(self, path: str) -> int:
        """:return: the size of ``path`` in bytes; raises ``OSError`` when it is missing or not a file."""

    def list(self, folder: str) -> list[str]:
        """:return: the names (not paths) directly in ``folder``; empty when it is missing."""

    def remove(self, path: str) -> None:
        """Delete ``path``; a missing file is not an error."""

    def remove_entry(self, folder: str, name: str) -> bool:
        """Delete the file ``name`` directly in ``folder``, following no symlink.

        :return: ``False`` when refused (nothing deleted): a symlink in ``folder``'s path or as the entry, or
            an entry that is not a regular file; ``True`` when it is gone (deleted, or missing).
        :raises ValueError: when ``name`` is not a plain file name.
        """

    def local_path(self, path: str) -> str | None:
        """
        :return: ``path`` on a local (or FUSE-mounted) file system that can be memory-mapped, or ``None`` when it
            must be read through :meth:`open_read`."""


def _fsync_dir(folder: str) -> None:
    """Best-effort fsync of a directory, so a new entry survives a crash."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class LocalStorage(Storage):
    """:class:`Storage` on a local or FUSE-mounted POSIX file system (methods documented there are not again)."""

    def write(self, path: str, data: Payload, *, atomic: bool = False) -> None:
        """Write, flush and fsync ``data`` to ``path`` in :func:`~gpu_resilience_worker.forkguard.write_privately` (the
        caller waits), as a new file written sequentially from its start (an existing one is deleted first, never
        truncated or overwritten in place). Errors of ``close()`` propagate (on Cloud Storage FUSE an upload fails
        there); an ``OSError`` without a path (``os.write``'s ENOSPC) is given the file's.

        :param path: destination file.
        :param data: the bytes, or a function writing them into the open file (it runs on that thread: it must
            keep neither the file nor its descriptor after it returns, pass neither on, nor start threads).
        :param atomic: write ``path + ".tmp"`` first, then rename it over ``path`` (atomic on local disks only).
        """
        folder = os.path.dirname(path) or "."
        os.makedirs(folder, exist_ok=True)
        target = path + ".tmp" if atomic else path
        with contextlib.suppress(FileNotFoundError):  # a new file: truncating an object makes GCS FUSE stage it
            os.remove(target)

        def write_file() -> None:
            with open(target, "xb", buffering=0) as handle:
                if callable(data):
                    data(handle)
                else:
                    fastio._write_all(handle, memoryview(data))
                os.fsync(handle.fileno())

        if callable(data):  # a checkpoint's writer hashes on these threads: not started in there
            fastio.start_hash_threads()
        try:  # no child process may hold the file: its close would finalize it early on GCS FUSE
            forkguard.write_privately(write_file)
        except OSError as exc:
            if exc.filename is None:  # say which file the disk was full for
                exc.filename = target
            raise
        if atomic:
            os.replace(target, path)
        _fsync_dir(folder)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as handle:
            return handle.read()

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb", buffering=0)

    def size(self, path: str) -> int:
        info = os.stat(path)
        if not os.path.isfile(path):
            raise IsADirectoryError(f"not a regular file: {path}")
        return info.st_size

    def list(self, folder: str) -> list[str]:
        try:
            return sorted(os.listdir(folder))
        except FileNotFoundError:
            return []

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def remove_entry(self, folder: str, name: str) -> bool:
        """Never through a symlink: ``folder`` must be its own real path (no symlink in any part of it), it is
        opened with ``O_NOFOLLOW``, and the entry is checked and unlinked relative to it.

        :return: as :meth:`Storage.remove_entry`; other ``OSError`` propagate.
        :raises ValueError: when ``name`` is not a plain file name.
        """
        if not name or name in (".", "..") or "/" in name:
            raise ValueError(f"name must be a plain file name, got {name!r}")
        if os.path.realpath(folder) != os.path.abspath(folder):
            return False  # a symlink anywhere on the way (O_NOFOLLOW covers only the last part)
        try:
            fd = os.open(folder.rstrip("/") or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a symlink (ENOTDIR: on some systems)
                return False
            raise
        try:
            if not stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                return False
            os.unlink(name, dir_fd=fd)
            return True
        except FileNotFoundError:
            return True
        finally:
            os.close(fd)

    def local_path(self, path: str) -> str:
        return path
