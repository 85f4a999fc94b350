"""The worker's goodput events: what only the worker knows about where an attempt's time went.

Each attempt writes its own file ``goodput-{execution}-{attempt}.json`` in the task namespace (a
new object name per attempt, never appended to or read back), rewritten at most once a second
(:data:`~gpu_resilience_worker.files.MIN_REWRITE_SECONDS`); times are Unix epoch seconds of the
worker's wall clock. The fields and how the provider's goodput account reads them are listed in
``docs/worker-contract.rst`` (the task folder's files).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

from gpu_resilience_worker.files import MIN_REWRITE_SECONDS, AdvisoryFile
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.preemption import process_age_seconds
from gpu_resilience_worker.storage import Storage
from gpu_resilience_worker.task_folder import GOODPUT_PREFIX, goodput_file_name  # noqa: F401 - re-exported

_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """The epoch time this process started.

    :return: from :func:`~gpu_resilience_worker.preemption.process_age_seconds` (to 10 ms), else
        this module's import time (where ``/proc`` is unreadable).
    """
    age = process_age_seconds()
    return min(time.time() - age, _IMPORTED_AT) if age > 0 else _IMPORTED_AT


class GoodputRecorder:
    """Collects one attempt's goodput events and writes them at most once a second.

    :param storage: the storage backend.
    :param namespace: the task folder.
    :param execution: ``CLOUD_RUN_EXECUTION`` (may be empty).
    :param task_index: ``CLOUD_RUN_TASK_INDEX``.
    :param attempt: ``CLOUD_RUN_TASK_ATTEMPT``.
    :param clock: wall clock, epoch seconds (default ``time.time``).
    :param min_interval: seconds between writes (default 1; never less than 1).
    :param logger: where a failed write is logged, once (:class:`~gpu_resilience_worker.files.AdvisoryFile`);
        default nowhere.
    """

    def __init__(self, storage: Storage, namespace: str, execution: str, task_index: int, attempt: int, *,
                 clock: Callable[[], float] = time.time, min_interval: float = MIN_REWRITE_SECONDS,
                 logger: StructuredLogger | None = None) -> None:
        self._clock = clock
        self._file = AdvisoryFile(storage, os.path.join(namespace, goodput_file_name(execution, attempt)), logger)
        self._min_interval = max(min_interval, MIN_REWRITE_SECONDS)
        self._last_write = float("-inf")
        self._step_time = 0.0
        self.record: dict[str, Any] = {
            "version": 1, "execution": execution, "task_index": task_index, "attempt": attempt,
            "process_start": round(process_start_time(), 3), "status": "running",
            "steps": 0, "step_seconds": None, "save_blocking_seconds": 0.0, "saves": 0,
            "resumed_from_step": 0, "steps_recomputed": 0,
        }

    @property
    def path(self) -> str:
        """The events file's path."""
        return self._file.path

    def restore(self, started: float, ended: float, resumed_from_step: int, steps_recomputed: int) -> None:
        """Record the checkpoint load (epoch seconds) and what it resumed from; written at once."""
        self.record.update(restore_start=round(started, 3), restore_end=round(ended, 3),
                           resumed_from_step=resumed_from_step, steps_recomputed=max(0, steps_recomputed))
        self.flush()

    def first_step(self, at: float | None = None) -> None:
        """Record that the training loop began its first step (once).

        :param at: when, in epoch seconds; default now."""
        self.record.setdefault("first_step_at", round(self._clock() if at is None else at, 3))

    def step(self, seconds: float) -> None:
        """Record one step of ``seconds`` (save stalls excluded); writes when a second has passed."""
        self._step_time += seconds
        self.record["steps"] += 1
        self.record["step_seconds"] = round(self._step_time / self.record["steps"], 6)
        self.flush(force=False)

    def save(self, blocking_seconds: float, saved: bool = True) -> None:
        """Record ``blocking_seconds`` the loop was blocked by checkpointing (a save, a wait for a
        background save, or a check that none is due); ``saved``: a save was made (counted)."""
        self.record["save_blocking_seconds"] = round(self.record["save_blocking_seconds"] + blocking_seconds, 6)
        self.record["saves"] += int(saved)

    def end(self, status: str, exit_code: int | None = None) -> None:
        """Record the attempt's end (``preempted``, ``completed`` or ``failed``) and write, waiting out the 1 s.

        ``ended_at`` is taken after that wait, just before the last write: the process ends right
        after it (the CLI exits at once), so the account bills an attempt whose Cloud Run times
        are unknown up to its real end, not up to a second before it.

        An attempt that never got as far as its restore (bad input or settings) writes no file: it
        leaves the namespace untouched, and the account counts it as start-up from the platform's times.
        """
        if self._last_write == float("-inf"):
            self.record.update(status=status, ended_at=round(self._clock(), 3), exit_code=exit_code)
            return
        since = time.monotonic() - self._last_write
        if since < self._min_interval:
            time.sleep(max(0.0, MIN_REWRITE_SECONDS - since))
        self.record.update(status=status, ended_at=round(self._clock(), 3), exit_code=exit_code)
        self.flush(force=True)

    def flush(self, force: bool = True) -> bool:
        """Write the file if due (``force``: now, after sleeping out the rest of the 1 s if needed).

        Never raises: an unwritable events file costs the account, never the training (a failed
        write is logged once, and counts as a write for the rate).

        :return: whether it was written.
        """
        since = time.monotonic() - self._last_write
        if since < self._min_interval:
            if not force:
                return False
            time.sleep(max(0.0, MIN_REWRITE_SECONDS - since))
        self.record["updated_at"] = round(self._clock(), 3)
        written = self._file.write((json.dumps(self.record, sort_keys=True) + "\n").encode())
        self._last_write = time.monotonic()
        return written
