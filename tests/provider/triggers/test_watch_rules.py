"""Table tests of the shared watcher's pure rules (triggers/watch_rules.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from airflow_gpu_resilience.triggers.watch_rules import (
    BACKOFF_CAP_SECONDS,
    MIN_POLL_INTERVAL,
    TASK_REFRESH_SECONDS,
    Counts,
    backoff_delay,
    counts_of,
    needs_tasks,
    pages,
    region_wide_is_fewer,
    task_execution,
    watch_interval,
)

RUN1 = Counts(running=1, succeeded=0, failed=0, cancelled=0, retried=0, finished=False)


@pytest.mark.parametrize("before, now, listed_ago, expected", [
    (None, RUN1, None, False),  # first sight, nothing ended yet: no task read
    (None, RUN1._replace(retried=1), None, True),  # first sight of a retried task
    (None, RUN1._replace(running=0, succeeded=1, finished=True), None, True),  # already finished
    (RUN1, RUN1, 5.0, False),  # nothing changed
    (RUN1._replace(running=0), RUN1, 5.0, False),  # a task started: no attempt ended
    (RUN1, RUN1._replace(running=0), 5.0, True),  # a running attempt ended, its retry pending
    (RUN1, RUN1._replace(running=0, succeeded=1), 5.0, True),
    (RUN1, RUN1._replace(running=0, failed=1, finished=True), 5.0, True),
    (RUN1, RUN1._replace(running=0, cancelled=1), 5.0, True),
    (RUN1, RUN1._replace(retried=1), 5.0, True),  # retried (and already running again)
    (RUN1, RUN1._replace(finished=True), 5.0, False),  # only the condition: its tasks were read
    # a task's second retry leaves the counts unchanged: re-read once the last read is stale
    (RUN1._replace(retried=1), RUN1._replace(retried=1), TASK_REFRESH_SECONDS - 1, False),
    (RUN1._replace(retried=1), RUN1._replace(retried=1), TASK_REFRESH_SECONDS, True),
    (RUN1._replace(retried=1), RUN1._replace(retried=1), None, True),
    (RUN1._replace(retried=1, finished=True), RUN1._replace(retried=1, finished=True), None, False),
    (RUN1, RUN1, TASK_REFRESH_SECONDS * 10, False),  # never retried: nothing to refresh
])
def test_needs_tasks(before, now, listed_ago, expected):
    assert needs_tasks(before, now, listed_ago) is expected


def test_counts_of_reads_the_execution_counts():
    execution = SimpleNamespace(running_count=2, succeeded_count=3, failed_count=1, cancelled_count=0, retried_count=4)
    assert counts_of(execution, finished=False) == Counts(2, 3, 1, 0, 4, False)


@pytest.mark.parametrize("requested, expected", [
    ([10.0], 10.0),
    ([10.0, 5.0, 30.0], 5.0),
    ([0.01], MIN_POLL_INTERVAL),
    ([], MIN_POLL_INTERVAL),
])
def test_watch_interval(requested, expected):
    assert watch_interval(requested) == expected


@pytest.mark.parametrize("task_counts, region_tasks, expected", [
    ({"a": 1, "b": 1}, 1000, True),  # 1 page for the region against 2 requests
    ({"a": 1, "b": 1}, 1001, False),  # 2 pages against 2 requests: not fewer
    ({"a": 1}, 10, False),  # one execution: its own read is never more
    ({"a": 1, "b": 1, "c": 1}, None, False),  # the region's total unknown (listing stopped early)
    ({str(i): 1 for i in range(100)}, 5000, True),
    ({"a": 3000, "b": 10}, 3500, False),  # 4 pages against 3 + 1
])
def test_region_wide_is_fewer(task_counts, region_tasks, expected):
    assert region_wide_is_fewer(task_counts, region_tasks, page_size=1000) is expected


@pytest.mark.parametrize("items, size, expected", [(0, 100, 1), (1, 100, 1), (100, 100, 1), (101, 100, 2)])
def test_pages(items, size, expected):
    assert pages(items, size) == expected


@pytest.mark.parametrize("failures, interval, low, high", [
    (1, 10.0, 10.0, 20.0),
    (2, 10.0, 20.0, 40.0),
    (3, 10.0, BACKOFF_CAP_SECONDS / 2, BACKOFF_CAP_SECONDS),
    (50, 10.0, BACKOFF_CAP_SECONDS / 2, BACKOFF_CAP_SECONDS),
    (1, 1.0, 1.0, 2.0),
    (3, 120.0, 120.0, 120.0),  # an interval above the cap: never shorter than the interval
])
def test_backoff_delay_bounds(failures, interval, low, high):
    rng = random.Random(7)
    delays = [backoff_delay(failures, interval, rng) for _ in range(200)]
    assert low <= min(delays) and max(delays) <= high


def test_backoff_delay_has_jitter():
    rng = random.Random(7)
    assert len({round(backoff_delay(3, 10.0, rng), 6) for _ in range(20)}) > 1


@pytest.mark.parametrize("task_name, expected", [
    ("projects/p/locations/r/jobs/j/executions/j-a/tasks/j-a-task0", "projects/p/locations/r/jobs/j/executions/j-a"),
    ("projects/p/locations/r/jobs/j/executions/j-a/tasks/j-a-task12", "projects/p/locations/r/jobs/j/executions/j-a"),
    ("projects/p/locations/r/jobs/j/executions/j-a", "projects/p/locations/r/jobs/j/executions/j-a"),
])
def test_task_execution(task_name, expected):
    assert task_execution(task_name) == expected
