"""One attempt's account in the task folder, the same for every way in.

The bundled worker and :class:`~gpu_resilience_worker.loop.ResilientLoop` (through which it
trains) and the framework adapters (:class:`~gpu_resilience_worker.artifacts.ArtifactCheckpoints`)
all report an attempt through :class:`Attempt`, so every task folder holds the same
``attempts.json``, ``progress.json`` and goodput events file (their fields: the task folder's
files in ``docs/worker-contract.rst``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from gpu_resilience_worker.config import TaskIdentity
from gpu_resilience_worker.errors import EXIT_OK, EXIT_PREEMPTED
from gpu_resilience_worker.files import (
    PROGRESS,
    ProgressReporter,
    highest_reported_step,
    read_json,
    record_attempt,
    reported_step,
)
from gpu_resilience_worker.goodput import GoodputRecorder
from gpu_resilience_worker.logs import StructuredLogger, utc_now
from gpu_resilience_worker.storage import Storage


def status_of(code: int) -> str:
    """The attempt's end status for its exit code.

    :return: ``completed`` (0), ``preempted`` (143), else ``failed``.
    """
    return {EXIT_OK: "completed", EXIT_PREEMPTED: "preempted"}.get(code, "failed")


class Attempt:
    """Records one attempt of a task: where it resumed, its steps, its saves and its end.

    :param storage: the storage backend.
    :param folder: the task folder.
    :param total_steps: optimizer steps of the whole run (for ``progress.json``).
    :param identity: the Cloud Run task identity (names the goodput file and the attempts entry).
    :param logger: structured logger.
    :param progress_interval: minimum seconds between ``progress.json`` writes; default 1.
    """

    def __init__(self, storage: Storage, folder: str, total_steps: int, identity: TaskIdentity,
                 logger: StructuredLogger, *, progress_interval: float = 1.0) -> None:
        self._storage, self._folder, self._log = storage, folder, logger
        self.total_steps, self.identity = total_steps, identity
        self._progress_interval = progress_interval
        self.goodput = GoodputRecorder(storage, folder, identity.execution, identity.task_index,
                                       identity.task_attempt, logger=logger)
        self.progress: ProgressReporter | None = None
        #: every recorded attempt of the run, oldest first (after :meth:`begin`)
        self.attempts: list[dict[str, Any]] = []
        self.step = 0
        self.loss: float | None = None

    def begin(self, resumed_from_step: int, restore_started: float, restore_ended: float | None = None) -> dict:
        """The attempt resumed (or started afresh at 0): records it in ``attempts.json``, the
        restore in the goodput file, and starts ``progress.json``.

        :param resumed_from_step: the step of the checkpoint resumed, 0 for none.
        :param restore_started: epoch seconds the restore began (the search for a checkpoint).
        :param restore_ended: epoch seconds it ended; default now.
        :return: this attempt's entry (``execution``, ``attempt``, ``task_index``,
            ``resumed_from_step``, ``lost_steps``).
        """
        step = self.step = resumed_from_step
        previous = read_json(self._storage, os.path.join(self._folder, PROGRESS)) or {}
        reported = reported_step(previous, total_steps=self.total_steps)
        lost = max(0, reported - step) if reported is not None else 0
        # steps this attempt computes again: up to the highest step any earlier attempt reached
        # (the last one may have been stopped before it got back to an earlier one's step)
        high_water = max(highest_reported_step(previous, self.total_steps) or 0, step)
        ended = time.time() if restore_ended is None else restore_ended
        self.goodput.restore(restore_started, ended, step, high_water - step)
        identity = self.identity
        entry = {"execution": identity.execution, "attempt": identity.task_attempt,
                 "task_index": identity.task_index, "resumed_from_step": step, "lost_steps": lost}
        self.attempts = record_attempt(self._storage, self._folder, {**entry, "started_at": utc_now()})
        if lost:
            self._log.warning(f"lost {lost} steps of work since the last checkpoint", lost_steps=lost,
                              last_reported_step=reported, resumed_from_step=step)
        self.progress = ProgressReporter(self._storage, self._folder, self.total_steps, step, self._log,
                                         min_interval=self._progress_interval, high_water_step=high_water)
        return entry

    def stepped(self, step: int, loss: float | None, seconds: float) -> None:
        """One step done: ``step`` steps in all, the running ``loss`` (or ``None``), and the
        ``seconds`` it took (save stalls excluded); ``progress.json`` is rewritten when due."""
        self.step, self.loss = step, loss
        self.goodput.first_step(time.time() - seconds)
        self.goodput.step(seconds)
        if self.progress is not None:
            self.progress.update(step, loss)

    def saved(self, blocking_seconds: float, saved: bool = True) -> None:
        """Training was blocked ``blocking_seconds`` by checkpointing; ``saved``: a save was made."""
        self.goodput.save(blocking_seconds, saved=saved)

    def report(self, status: str, max_wait: float = 1.0) -> None:
        """Write ``progress.json`` now with ``status`` (``preempted``, ``completed``), waiting at
        most ``max_wait`` seconds for its one-second rewrite limit."""
        if self.progress is not None:
            self.progress.update(self.step, self.loss, status=status, force=True, max_wait=max_wait)

    def end(self, code: int) -> None:
        """The attempt ends with exit ``code``: the goodput file gets its status (:func:`status_of`)."""
        self.goodput.end(status_of(code), code)

    @property
    def lost_steps_total(self) -> int:
        """The steps lost over every recorded attempt."""
        return sum(int(a.get("lost_steps") or 0) for a in self.attempts)
