"""A storage wrapper that pauses inside checkpoint writes, so tests can kill a worker there.

``python -m tests.worker.pausing train [flags]`` runs the worker on it, reading the pauses from
``WORKER_TEST_PAUSE_BEFORE_COMMIT_SECONDS`` (sleep before each commit record is written, after
the data file is), ``WORKER_TEST_PAUSE_MID_WRITE_SECONDS`` (write half of each data file, log
``checkpoint data half written``, sleep with the file still open, then write the rest) and
``WORKER_TEST_PAUSE_MID_READ_SECONDS`` (each read of a data file's second half sleeps first, the
first of them after logging ``checkpoint data half read``: a slow restore, for a SIGTERM during it)
and ``WORKER_TEST_PAUSE_WHEN_FULL_SECONDS`` (a data file write that fails with ENOSPC keeps the file
open, the disk full, until a write of ``progress.json`` has been tried, at most that many seconds).
"""

from __future__ import annotations

import errno
import io
import os
import threading
import time
from typing import BinaryIO, Mapping

from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.storage import LocalStorage, Payload


class PausingStorage(LocalStorage):
    """:class:`~gpu_resilience_worker.storage.LocalStorage` with pauses in checkpoint writes.

    :param before_commit_s: seconds to sleep before writing a ``.commit.json``; default 0.
    :param mid_write_s: seconds to sleep with half of a ``.pt`` data file written (and the file
        open); default 0.
    :param mid_read_s: seconds to sleep before each read of the second half of a ``.pt`` data
        file (a read is at most 8 MiB in a restore); default 0.
    :param logger: where ``checkpoint data half written`` (and ``half read``) goes; default stdout.
    :param when_full_s: the longest hold of a full disk by a data file write that failed with ENOSPC
        (its file still open) until a ``progress.json`` write has been tried; default 0 (none).
    """

    def __init__(self, before_commit_s: float = 0.0, mid_write_s: float = 0.0,
                 logger: StructuredLogger | None = None, mid_read_s: float = 0.0, when_full_s: float = 0.0) -> None:
        if before_commit_s < 0 or mid_write_s < 0 or mid_read_s < 0 or when_full_s < 0:
            raise ValueError("pauses must be >= 0 seconds")
        self.before_commit_s, self.mid_write_s, self.mid_read_s = before_commit_s, mid_write_s, mid_read_s
        self.when_full_s = when_full_s
        self._progress_tried = threading.Event()
        self._log = logger or StructuredLogger()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> PausingStorage:
        """:return: the storage with the pauses of the ``WORKER_TEST_PAUSE_*`` variables."""
        return cls(float(env.get("WORKER_TEST_PAUSE_BEFORE_COMMIT_SECONDS", "0") or 0),
                   float(env.get("WORKER_TEST_PAUSE_MID_WRITE_SECONDS", "0") or 0),
                   mid_read_s=float(env.get("WORKER_TEST_PAUSE_MID_READ_SECONDS", "0") or 0),
                   when_full_s=float(env.get("WORKER_TEST_PAUSE_WHEN_FULL_SECONDS", "0") or 0))

    def open_read(self, path: str) -> BinaryIO:
        """Open like :class:`LocalStorage`; a data file's reader pauses in its second half."""
        handle = super().open_read(path)
        if not (self.mid_read_s and path.endswith(".pt")):
            return handle
        return _PausingReader(handle, self.size(path) // 2, self.mid_read_s, self._log, path)

    def write(self, path: str, data: Payload, *, atomic: bool = False) -> None:
        """Write like :class:`LocalStorage`, pausing as configured."""
        if self.before_commit_s and path.endswith(".commit.json"):
            time.sleep(self.before_commit_s)
        if self.mid_write_s and path.endswith(".pt"):
            if callable(data):
                buffer = io.BytesIO()
                data(buffer)  # type: ignore[arg-type]
                data = buffer.getvalue()
            data = self._in_two_halves(path, bytes(data))
        if self.when_full_s and path.endswith(".pt"):
            data = self._holding_when_full(path, data)
        try:
            super().write(path, data, atomic=atomic)
        finally:
            if path.endswith("progress.json"):
                self._progress_tried.set()

    def _holding_when_full(self, path: str, data):
        """:return: a function writing ``data`` into the open file that, when a write fails with
        ENOSPC, keeps the file open (the disk full) until a ``progress.json`` write was tried (at
        most :attr:`when_full_s`), logging ``disk kept full``, then raises the error."""
        def write(handle) -> None:
            try:
                if callable(data):
                    data(handle)
                else:
                    view = memoryview(data)
                    while view.nbytes:
                        view = view[handle.write(view):]
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    self._progress_tried.clear()  # from now on the disk is full
                    tried = self._progress_tried.wait(self.when_full_s)
                    self._log.debug("disk kept full", file=path, progress_write_tried=tried)
                raise

        return write

    def _in_two_halves(self, path: str, data: bytes):
        """:return: a function writing ``data`` into the open file in two halves, logging
        ``checkpoint data half written`` (``bytes`` written, ``of`` in all) and sleeping between
        them with the file still open: a writer killed there is closed by the kernel, not by
        itself (on Cloud Storage FUSE that close finalizes the short object)."""
        def write(handle) -> None:
            half = len(data) // 2
            for start, end in ((0, half), (half, len(data))):
                view = memoryview(data)[start:end]
                while view.nbytes:
                    view = view[handle.write(view):]
                if start == 0:
                    self._log.debug("checkpoint data half written", file=path, bytes=half, of=len(data))
                    time.sleep(self.mid_write_s)

        return write


class _PausingReader(io.RawIOBase):
    """A reader that sleeps before each read that starts at or past ``half``, logging
    ``checkpoint data half read`` before the first of them."""

    def __init__(self, handle: BinaryIO, half: int, pause_s: float, logger: StructuredLogger, path: str) -> None:
        super().__init__()
        self._handle, self._half, self._pause_s, self._log, self._path = handle, half, pause_s, logger, path
        self._position = 0
        self._paused = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._position >= self._half:
            if not self._paused:
                self._paused = True
                self._log.debug("checkpoint data half read", file=self._path, bytes=self._position)
            time.sleep(self._pause_s)
        count = self._handle.readinto(buffer) or 0
        self._position += count
        return count

    def close(self) -> None:
        self._handle.close()
        super().close()


if __name__ == "__main__":
    from gpu_resilience_trainer.__main__ import main
    from gpu_resilience_worker.preemption import exit_now

    exit_now(main(storage=PausingStorage.from_env(os.environ)))

