"""The pure rules of the shared execution watcher (:mod:`.execution_watcher`): no I/O, no clock.

- :func:`watch_interval`: how often a region is listed, from what its subscribers ask for.
- :func:`counts_of` and :func:`needs_tasks`: whether an execution's tasks must be read this poll.
  An Execution carries its running, succeeded, failed, cancelled and retried counts; a finished
  task attempt changes at least one of them, except a retry of a task that was already retried
  (``retriedCount`` counts tasks retried at least once), which is caught by the running count
  dipping or, at the latest, by :data:`TASK_REFRESH_SECONDS`.
- :func:`region_wide_is_fewer`: one ``ListTasks`` of every task of the region
  (``jobs/-/executions/-``) or one per execution, whichever takes fewer requests.
- :func:`task_execution`: which execution a task of a region-wide ``ListTasks`` belongs to.
- :func:`backoff_delay`: the wait after failed polls (429, 503, a timeout), with jitter, so that
  several triggerers do not retry in step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from typing import NamedTuple

#: Shortest poll interval a watcher uses, whatever its triggers ask for (seconds): it keeps a
#: watcher from spinning. It does not keep a region within its read quota (600 a minute is one
#: listing every 0.1 s); the backoff after a 429 does, and the default interval (10 s) is far from it.
MIN_POLL_INTERVAL = 0.05
#: An execution with retried tasks has its tasks re-read at least this often (seconds), to record
#: the result of a task's second and later retries, which leave every count unchanged.
TASK_REFRESH_SECONDS = 60.0
#: Longest wait after failed polls (seconds); Cloud Run's read quota is counted per minute.
BACKOFF_CAP_SECONDS = 60.0


class Counts(NamedTuple):
    """The task counts of an execution (``run_v2.Execution``'s ``*_count`` fields) and whether it finished."""

    running: int
    succeeded: int
    failed: int
    cancelled: int
    retried: int
    finished: bool

    @property
    def ended_attempts(self) -> bool:
        """Whether any attempt may have ended: a task finished or was retried."""
        return self.succeeded + self.failed + self.cancelled + self.retried > 0


def counts_of(execution, finished: bool) -> Counts:
    """The :class:`Counts` of an execution.

    :param execution: a ``run_v2.Execution`` (or anything with its ``*_count`` attributes).
    :param finished: whether the execution is no longer running.
    """
    return Counts(execution.running_count, execution.succeeded_count, execution.failed_count,
                  execution.cancelled_count, execution.retried_count, finished)


def needs_tasks(before: Counts | None, now: Counts, listed_ago: float | None) -> bool:
    """Whether an execution's tasks must be read to record its finished attempts.

    :param before: its counts when its tasks were last read or judged unchanged; ``None`` at the
        first sight of it.
    :param now: its counts in this poll.
    :param listed_ago: seconds since its tasks were last read, ``None`` if never.
    :return: at the first sight, whether any attempt may have ended; later, whether a task
        finished or was retried (a count other than running changed), a running attempt ended
        (running fell), or a running execution with retried tasks was last read
        :data:`TASK_REFRESH_SECONDS` or more ago.
    """
    if before is None:
        return now.ended_attempts
    if now[1:5] != before[1:5] or now.running < before.running:
        return True
    stale = listed_ago is None or listed_ago >= TASK_REFRESH_SECONDS
    return now.retried > 0 and not now.finished and stale


def watch_interval(requested: Iterable[float]) -> float:
    """The poll interval of a watcher: the smallest its subscribers ask for, at least
    :data:`MIN_POLL_INTERVAL`.

    :param requested: every subscriber's ``poll_interval`` (seconds); none: the minimum.
    """
    return max(MIN_POLL_INTERVAL, min(requested, default=MIN_POLL_INTERVAL))


def pages(items: int, page_size: int) -> int:
    """Requests a listing of ``items`` takes at ``page_size`` per page (at least one)."""
    return max(1, math.ceil(items / page_size))


def region_wide_is_fewer(task_counts: Mapping[str, int], region_tasks: int | None, page_size: int) -> bool:
    """Whether one region-wide ``ListTasks`` takes fewer requests than one per execution.

    :param task_counts: the executions whose tasks are needed -> their ``task_count``.
    :param region_tasks: every task of the region (the sum of ``task_count`` over a complete
        listing of its executions), ``None`` when unknown (the listing stopped early).
    :param page_size: tasks per page.
    :return: ``True`` when the region total is known and its pages are fewer.
    """
    if region_tasks is None or len(task_counts) < 2:
        return False
    return pages(region_tasks, page_size) < sum(pages(count, page_size) for count in task_counts.values())


def backoff_delay(failures: int, interval: float, rng: random.Random) -> float:
    """Seconds to wait after ``failures`` failed polls in a row.

    The ceiling doubles from ``interval`` with each failure up to :data:`BACKOFF_CAP_SECONDS`
    (or ``interval`` if that is longer); the delay is drawn between half the ceiling and the
    ceiling ("equal jitter"), and is never below ``interval``.

    :param failures: failed polls in a row (>= 1).
    :param interval: the watcher's poll interval (seconds).
    :param rng: the random source (seeded in tests).
    """
    ceiling = min(max(BACKOFF_CAP_SECONDS, interval), interval * 2 ** min(failures, 32))
    return max(interval, ceiling / 2 + rng.uniform(0, ceiling / 2))


def task_execution(task_name: str) -> str:
    """The full name of a task's execution, from the task's full name (how a region-wide
    ``ListTasks`` is grouped by execution).

    :param task_name: ``projects/P/locations/R/jobs/J/executions/E/tasks/T``.
    :return: ``projects/P/locations/R/jobs/J/executions/E``; a name without ``/tasks/`` unchanged.
    """
    return task_name.rsplit("/tasks/", 1)[0]
