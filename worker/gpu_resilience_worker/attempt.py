"""One attempt's account in the task folder, the same for every way in: :class:`Attempt`.

:class:`~gpu_resilience_worker.loop.ResilientLoop` (and the bundled trainer through it) and the framework adapters
(:class:`~gpu_resilience_worker.artifacts.ArtifactCheckpoints`) all report through it, so every task folder holds
the same ``attempts.json``, ``progress.json``, goodput events file (where the attempt's time went, which only the
worker knows) and, once the run is complete, ``metrics.json`` (fields: ``docs/worker-contract.rst``)."""

from __future__ import annotations

import atexit
import json
import os
import time
from typing import Any, Callable, Mapping

from gpu_resilience_worker.config import TaskIdentity
from gpu_resilience_worker.errors import EXIT_FAILURE, EXIT_OK, EXIT_PREEMPTED
from gpu_resilience_worker.files import (
    METRICS, PROGRESS, AdvisoryFile, ProgressReporter, highest_reported_step, read_json, record_attempt,
    reported_step, write_json,
)
from gpu_resilience_worker.logs import StructuredLogger, utc_now
from gpu_resilience_worker.preemption import process_age_seconds
from gpu_resilience_worker.storage import Storage
from gpu_resilience_worker.task_folder import goodput_file_name

_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """The epoch time this process started.

    :return: from :func:`~gpu_resilience_worker.preemption.process_age_seconds` (to 10 ms), else this module's
        import time (where ``/proc`` is unreadable)."""
    age = process_age_seconds()
    return min(time.time() - age, _IMPORTED_AT) if age > 0 else _IMPORTED_AT


def status_of(code: int) -> str:
    """:return: the end status for exit ``code``: ``completed`` (0), ``preempted`` (143), else ``failed``."""
    return {EXIT_OK: "completed", EXIT_PREEMPTED: "preempted"}.get(code, "failed")


class Attempt:
    """Records one attempt of a task: where it resumed, its steps, its saves and its end. One that began and is
    still open when the interpreter exits (an exception ended the user's script) ends there as ``failed``, exit 1.

    :param storage: the storage backend.
    :param folder: the task folder.
    :param total_steps: optimizer steps of the whole run (for ``progress.json``).
    :param identity: the Cloud Run task identity (names the goodput file and the attempts entry);
        default the environment's (the defaults where it is malformed).
    :param logger: structured logger; default one on stdout.
    :param progress_interval: minimum seconds between ``progress.json`` writes; default 1.
    :param clock: wall clock, epoch seconds; default ``time.time``."""

    def __init__(self, storage: Storage, folder: str, total_steps: int, identity: TaskIdentity | None = None,
                 logger: StructuredLogger | None = None, *, progress_interval: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._storage, self._folder, self._log = storage, folder, logger or StructuredLogger()
        self.total_steps, self._progress_interval, self._clock = total_steps, progress_interval, clock
        identity = self.identity = identity or TaskIdentity.from_env(os.environ, fallback=True)
        self._file = AdvisoryFile(storage, os.path.join(folder, goodput_file_name(identity.execution,
                                                                                  identity.task_attempt)), self._log)
        #: the goodput events, as the file holds them
        self.events: dict[str, Any] = {
            "version": 1, "execution": identity.execution, "task_index": identity.task_index,
            "attempt": identity.task_attempt, "process_start": round(process_start_time(), 3), "status": "running",
            "steps": 0, "step_seconds": None, "save_blocking_seconds": 0.0, "saves": 0,
            "resumed_from_step": 0, "steps_recomputed": 0,
        }
        self.progress: ProgressReporter | None = None
        #: every recorded attempt of the run, oldest first (after :meth:`begin`)
        self.attempts: list[dict[str, Any]] = []
        self.step, self.loss, self.ended = 0, None, False
        self._step_time, self._blocked, self._last_step_end = 0.0, 0.0, time.monotonic()

    @property
    def path(self) -> str:
        """The goodput events file's path."""
        return self._file.path

    def begin(self, resumed_from_step: int, restore_started: float, restore_ended: float | None = None) -> dict:
        """The attempt resumed (or started afresh at 0): records it in ``attempts.json``, the restore in the goodput
        file (written at once), and starts ``progress.json``.

        :param resumed_from_step: the step of the checkpoint resumed, 0 for none.
        :param restore_started: epoch seconds the restore began (the search for a checkpoint).
        :param restore_ended: epoch seconds it ended; default now.
        :return: its entry (``execution``, ``attempt``, ``task_index``, ``resumed_from_step``, ``lost_steps``)."""
        step = self.step = resumed_from_step
        previous = read_json(self._storage, os.path.join(self._folder, PROGRESS)) or {}
        reported = reported_step(previous, total_steps=self.total_steps)
        lost = max(0, reported - step) if reported is not None else 0
        # recomputed: up to the highest step any earlier attempt reached (the last may have stopped short of it)
        high_water = max(highest_reported_step(previous, self.total_steps) or 0, step)
        ended = self._clock() if restore_ended is None else restore_ended
        self.events.update(restore_start=round(restore_started, 3), restore_end=round(ended, 3),
                           resumed_from_step=step, steps_recomputed=high_water - step)
        self._flush(force=True)
        entry = {"execution": self.identity.execution, "attempt": self.identity.task_attempt,
                 "task_index": self.identity.task_index, "resumed_from_step": step, "lost_steps": lost}
        self.attempts = record_attempt(self._storage, self._folder, {**entry, "started_at": utc_now()})
        if lost:
            self._log.warning(f"lost {lost} steps of work since the last checkpoint", lost_steps=lost,
                              last_reported_step=reported, resumed_from_step=step)
        self.progress = ProgressReporter(self._storage, self._folder, self.total_steps, step, self._log,
                                         min_interval=self._progress_interval, high_water_step=high_water)
        self._last_step_end, self._blocked = time.monotonic(), 0.0
        atexit.register(self._end_at_exit)
        return entry

    def stepped(self, step: int, loss: float | None = None) -> None:
        """One step ended: ``step`` steps in all, the running ``loss`` (or ``None``). Its time since the previous
        step's end (or the restore's), less the time checkpointing blocked training meanwhile (:meth:`saved`), goes
        to the goodput file; ``progress.json`` is rewritten when due."""
        now = time.monotonic()
        seconds = max(0.0, now - self._last_step_end - self._blocked)
        self._last_step_end, self._blocked = now, 0.0
        self.step, self.loss = step, loss
        self.events.setdefault("first_step_at", round(self._clock() - seconds, 3))
        self._step_time += seconds
        self.events["steps"] += 1
        self.events["step_seconds"] = round(self._step_time / self.events["steps"], 6)
        self._flush(force=False)
        if self.progress is not None:
            self.progress.update(step, loss)

    def saved(self, blocking_seconds: float, saved: bool = True) -> None:
        """Training was blocked ``blocking_seconds`` by checkpointing (a save, a wait for a background save, or a
        check that none is due); ``saved``: a save was made (counted)."""
        self._blocked += blocking_seconds
        self.events["save_blocking_seconds"] = round(self.events["save_blocking_seconds"] + blocking_seconds, 6)
        self.events["saves"] += int(saved)

    def report(self, status: str, max_wait: float = 1.0) -> None:
        """Write ``progress.json`` now with ``status`` (``preempted``, ``completed``), waiting at most ``max_wait``
        seconds for its one-second rewrite limit."""
        if self.progress is not None:
            self.progress.update(self.step, self.loss, status=status, force=True, max_wait=max_wait)

    def complete(self, metrics: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The run is complete: write ``metrics.json`` (``metrics``, then ``steps``, ``total_steps``, ``final_loss``,
        ``attempts``, ``lost_steps_total``) and report ``completed``.

        :param metrics: the driver's and the user's metrics (JSON types).
        :return: what ``metrics.json`` holds."""
        written = {**dict(metrics or {}), "steps": self.step, "total_steps": self.total_steps,
                   "final_loss": self.loss, "attempts": self.attempts, "lost_steps_total": self.lost_steps_total}
        write_json(self._storage, os.path.join(self._folder, METRICS), written)
        self.report("completed")
        return written

    def end(self, code: int) -> None:
        """The attempt ends with exit ``code``: the goodput file gets its status (:func:`status_of`), once, written
        after the wait for the one-second rule (the process ends right after it, so an attempt whose Cloud Run times
        are unknown is billed to its real end). One that never got as far as its restore writes no file."""
        if self.ended:
            return
        self.ended = True
        atexit.unregister(self._end_at_exit)
        written = self._file.last_write != float("-inf")
        if written:
            self._file.wait_for_rule()
        self.events.update(status=status_of(code), ended_at=round(self._clock(), 3), exit_code=code)
        if written:
            self._flush(force=True)

    def _end_at_exit(self) -> None:
        self._log.error("the attempt ended with an exception", exit_code=EXIT_FAILURE, step=self.step)
        self.end(EXIT_FAILURE)

    def _flush(self, force: bool) -> bool:
        """Write the goodput file if due (``force``: now, after waiting out the one-second rule). Never raises: an
        unwritable events file costs the account, never the training."""
        if not (self._file.due() or (force and not self._file.wait_for_rule())):
            return False
        self.events["updated_at"] = round(self._clock(), 3)
        return self._file.write((json.dumps(self.events, sort_keys=True) + "\n").encode())

    @property
    def lost_steps_total(self) -> int:
        """The steps lost over every recorded attempt."""
        return sum(int(a.get("lost_steps") or 0) for a in self.attempts)
