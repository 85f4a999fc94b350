"""The small JSON files in the task namespace: ``progress.json``, ``metrics.json``, ``attempts.json`` (names
from :mod:`gpu_resilience_worker.task_folder`, re-exported here)."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable, Mapping

from gpu_resilience_worker.logs import StructuredLogger, utc_now
from gpu_resilience_worker.storage import Storage
from gpu_resilience_worker.task_folder import ATTEMPTS, FATAL, METRICS, PROGRESS  # noqa: F401 - re-exported
#: Fewest seconds between two writes of one file name: Cloud Storage accepts about one mutation per second per object.
MIN_REWRITE_SECONDS = 1.0


def json_bytes(obj: dict[str, Any]) -> bytes:
    """:return: ``obj`` as the namespace's JSON files hold it (keys sorted, one per line)."""
    return (json.dumps(obj, sort_keys=True, indent=1) + "\n").encode()


def write_json(storage: Storage, path: str, obj: dict[str, Any]) -> None:
    """Write ``obj`` as JSON through a temp file, fsync and rename."""
    storage.write(path, json_bytes(obj), atomic=True)


class AdvisoryFile:
    """A file of the namespace no run depends on (``progress.json``, a goodput events file), never written twice
    within :data:`MIN_REWRITE_SECONDS`. A write failing with an ``OSError`` (a full disk: ENOSPC, EDQUOT; a mount's
    EIO) is tolerated and logged at WARNING once for this file: on a full disk the checkpoint saves' rule decides
    (three failed in a row: exit 74), not a progress write.

    :param storage: the storage backend.
    :param path: the file's path.
    :param logger: where the one warning goes; ``None``: nowhere.
    :param min_interval: seconds between writes when not forced; default and at least 1.
    :param clock: monotonic clock in seconds.
    :param sleep: sleeps this many seconds (to wait out the one-second rule).
    """

    def __init__(self, storage: Storage, path: str, logger: StructuredLogger | None, *,
                 min_interval: float = MIN_REWRITE_SECONDS, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.storage, self.path, self._log = storage, path, logger
        self.min_interval, self.clock, self._sleep = max(min_interval, MIN_REWRITE_SECONDS), clock, sleep
        self.failures = 0
        #: ``clock`` time of the last write (tried), ``-inf`` before any
        self.last_write = float("-inf")

    def due(self) -> bool:
        """:return: whether ``min_interval`` passed since the last write."""
        return self.clock() - self.last_write >= self.min_interval

    def wait_for_rule(self, max_wait: float = math.inf) -> float:
        """Sleep out the rest of the second since the last write, unless that is more than ``max_wait``.

        :return: 0 when a write may go now, else the seconds it would have to wait.
        """
        rest = MIN_REWRITE_SECONDS - (self.clock() - self.last_write)
        if rest <= 0 or rest > max_wait:
            return max(rest, 0.0)
        self._sleep(rest)
        return 0.0

    def write(self, data: bytes) -> bool:
        """Write ``data`` through a temporary name (atomically). :return: whether it was written
        (a failed write counts as a write for the rate)."""
        try:
            self.storage.write(self.path, data, atomic=True)
        except OSError as exc:
            self.failures += 1
            if self.failures == 1 and self._log is not None:
                self._log.warning(f"could not write {os.path.basename(self.path)}; going on without it (logged once)",
                                  file=self.path, error=f"{type(exc).__name__}: {exc}")
            return False
        finally:
            self.last_write = self.clock()
        return True


def read_json(storage: Storage, path: str) -> dict[str, Any] | None:
    """:return: the JSON object in ``path``, or ``None`` when missing, torn or not an object."""
    try:
        obj = json.loads(storage.read(path).decode())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


class ProgressReporter:
    """Writes ``progress.json`` (an :class:`AdvisoryFile`) at most every ``min_interval`` seconds, and logs
    progress. A forced write (a status change: preempted, completed) within :data:`MIN_REWRITE_SECONDS` of the last
    first sleeps the rest of that second, or, when ``max_wait`` is shorter than that rest, is skipped (logged at INFO).

    :param storage: the storage backend.
    :param namespace: the task folder.
    :param total_steps: steps of the whole run.
    :param start_step: the step this attempt started from (for steps per second).
    :param logger: structured logger.
    :param min_interval: minimum seconds between writes; default 1, at least :data:`MIN_REWRITE_SECONDS`.
    :param log_interval: minimum seconds between progress log lines, unless forced; default 5.
    :param clock: monotonic clock in seconds.
    :param sleep: sleeps this many seconds (for a forced write within a second of the last).
    :param high_water_step: the highest step an earlier attempt reached (:func:`highest_reported_step`); the
        file's ``high_water_step`` is the highest of it and every step written since. Default 0.
    """

    def __init__(self, storage: Storage, namespace: str, total_steps: int, start_step: int, logger: StructuredLogger,
                 *, min_interval: float = 1.0, log_interval: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, high_water_step: int = 0) -> None:
        self._file = AdvisoryFile(storage, os.path.join(namespace, PROGRESS), logger, min_interval=min_interval,
                                  clock=clock, sleep=sleep)
        self.total_steps, self.start_step = total_steps, start_step
        self.high_water_step = max(high_water_step, start_step)
        self._log, self._clock, self._log_interval = logger, clock, log_interval
        self._started, self._last_log = clock(), float("-inf")

    def update(self, step: int, loss: float | None, *, status: str = "running", force: bool = False,
               max_wait: float = MIN_REWRITE_SECONDS) -> bool:
        """Write progress now if forced or due.

        :param step: steps done.
        :param loss: the running loss, or ``None`` before any step.
        :param status: ``running``, ``preempted`` or ``completed``.
        :param force: write regardless of ``min_interval`` (still never within 1 s of the last).
        :param max_wait: for a forced write, the longest sleep (seconds) for the 1 s to pass; default 1 (always wait).
        :return: whether the file was written (a failed write is logged once and tolerated: :class:`AdvisoryFile`).
        """
        if not (force or self._file.due()):
            return False
        if rest := self._file.wait_for_rule(max_wait):
            self._log.info("progress write skipped: written less than a second ago",
                           step=step, status=status, wait_seconds=round(rest, 3))
            return False
        now = self._clock()
        elapsed = now - self._started
        rate = (step - self.start_step) / elapsed if elapsed > 0 else 0.0
        eta = round((self.total_steps - step) / rate, 1) if rate > 0 else None
        self.high_water_step = max(self.high_water_step, step)
        written = self._file.write(json_bytes({
            "step": step, "total_steps": self.total_steps, "status": status, "updated_at": utc_now(),
            "loss": loss, "steps_per_second": round(rate, 3), "high_water_step": self.high_water_step}))
        if force or now - self._last_log >= self._log_interval:
            self._last_log = now
            self._log.info(f"progress: step {step}/{self.total_steps}", step=step,
                           total_steps=self.total_steps, loss=loss, steps_per_second=round(rate, 3),
                           eta_seconds=eta, status=status)
        return written


def reported_step(previous: Mapping[str, Any], keys: tuple[str, ...] = ("step",),
                  total_steps: int | None = None) -> int | None:
    """A step an earlier attempt reported in its ``progress.json``, bounded by the run. ``step`` is the last attempt's;
    ``high_water_step`` the highest of every attempt's, so that an attempt stopped before it got back to an earlier
    one's step does not hide the steps that one lost (the next resume recomputes them). The file is only a report (no
    commit record vouches for it): a claim beyond ``total_steps`` (a torn or forged file) counts as ``total_steps``.

    :param previous: the parsed ``progress.json`` (``{}`` when there is none).
    :param keys: the fields to read; the highest is taken (default ``("step",)``).
    :param total_steps: the run's steps, the bound; ``None`` or 0: unbounded.
    :return: the highest of ``keys`` that is an integer >= 0, bounded, else ``None``.
    """
    steps = [v for v in map(previous.get, keys) if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    if not steps:
        return None
    return min(max(steps), total_steps) if total_steps else max(steps)


def highest_reported_step(previous: Mapping[str, Any], total_steps: int | None = None) -> int | None:
    """The highest step any earlier attempt reached: :func:`reported_step` of ``step`` and
    ``high_water_step``, bounded by ``total_steps`` when given."""
    return reported_step(previous, ("step", "high_water_step"), total_steps)


def record_attempt(storage: Storage, namespace: str, entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Append ``entry`` to ``attempts.json``, after :func:`with_unrecorded_attempts`. An attempt records itself once
    it has restored its checkpoint, before its first step; one stopped before that (a preemption or a kill during
    its start or restore, or between its "resuming" log line and this write) cannot, and the next attempt lists it.

    :return: all recorded attempts, oldest first.
    """
    path = os.path.join(namespace, ATTEMPTS)
    recorded = (read_json(storage, path) or {}).get("attempts", [])
    attempts = with_unrecorded_attempts([a for a in recorded if isinstance(a, dict)] if isinstance(recorded, list)
                                        else [], entry)
    write_json(storage, path, {"attempts": attempts})
    return attempts


def with_unrecorded_attempts(recorded: list[dict[str, Any]], entry: dict[str, Any]) -> list[dict[str, Any]]:
    """``recorded`` + ``entry``, with an entry for every attempt of ``entry``'s execution and task index numbered
    below ``entry["attempt"]`` that no record names: Cloud Run numbers a task's attempts from 0 within an execution
    (``CLOUD_RUN_TASK_ATTEMPT``), so such a number is an attempt stopped before it recorded itself. Its entry is
    ``{"execution", "attempt", "task_index", "resumed_from_step": None, "lost_steps": 0, "unrecorded": True}``: it
    trained no step (an attempt records itself before its first); the work lost before it is counted by the next
    attempt that resumed (from ``progress.json``).

    :param recorded: the entries read from ``attempts.json``, oldest first.
    :param entry: this attempt's entry; without an integer ``attempt``, nothing is added for it.
    :return: a new list: ``recorded``, the missing attempts in number order, then ``entry``.
    """
    number = entry.get("attempt")
    if not isinstance(number, int) or isinstance(number, bool):
        return [*recorded, entry]
    key = (entry.get("execution"), entry.get("task_index"))
    seen = {a.get("attempt") for a in recorded if (a.get("execution"), a.get("task_index")) == key}
    missing = [{"execution": key[0], "attempt": n, "task_index": key[1], "resumed_from_step": None,
                "lost_steps": 0, "unrecorded": True} for n in range(number) if n not in seen]
    return [*recorded, *missing, entry]
