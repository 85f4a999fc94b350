"""A task instance's checkpoint progress, from the worker's files in the checkpoint bucket.

The run manager's reads of the bucket, through
:class:`~airflow_gpu_resilience.hooks.progress.CheckpointFilesHook` (best effort: an unreadable
file never fails the task): the newest committed checkpoint step of every task, the progress
history of the task instance's executions built from it, the tasks' ``progress.json`` lines and
the work each preemption lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from google.cloud import run_v2
from google.cloud.storage.retry import DEFAULT_RETRY

from airflow_gpu_resilience.hooks.cloud_run import execution_env
from airflow_gpu_resilience.hooks.progress import CheckpointFilesHook
from airflow_gpu_resilience.outcome import OutcomeClass
from airflow_gpu_resilience.rerun_budget import ExecutionProgress
from airflow_gpu_resilience.run_state import (
    DEFAULT_PROGRESS_READ_TIMEOUT,
    START_STEPS_ENV,
    LostWork,
    RunState,
    comparable_steps,
    decode_steps,
)

__all__ = ["MAX_PROGRESS_TASKS", "CheckpointProgress", "progress_history"]

#: Most tasks whose progress files are read (per poll) and whose lost work is reported.
MAX_PROGRESS_TASKS = 16


def progress_history(
    executions: Sequence[run_v2.Execution],
    now: Mapping[int, int] | None,
    class_of: Callable[[run_v2.Execution], OutcomeClass | None],
) -> list[ExecutionProgress]:
    """Every execution with its checkpoint steps at its start and at its end.

    An execution's start is what it recorded in
    :data:`~airflow_gpu_resilience.run_state.START_STEPS_ENV`; its end is the next one's start,
    or ``now`` for the newest.

    :param executions: the task instance's executions, oldest first.
    :param now: task index -> newest committed step in the bucket now, or ``None`` when unknown.
    :param class_of: an execution's class, ``None`` while it runs.
    :return: the history, oldest first.
    """
    starts = [decode_steps(execution_env(e).get(START_STEPS_ENV)) for e in executions]
    history = []
    for i, execution in enumerate(executions):
        start, end = comparable_steps(starts[i], starts[i + 1] if i + 1 < len(executions) else now)
        history.append(ExecutionProgress(execution.name, class_of(execution), start, end))
    return history


class CheckpointProgress:
    """Reads one job's task folders in the checkpoint bucket for the run manager.

    :param files: the hook on ``gs://{bucket}/{prefix}/``.
    :param log: the task's logger.
    """

    def __init__(self, files: CheckpointFilesHook, log: logging.Logger | logging.LoggerAdapter) -> None:
        self.files, self.log = files, log

    @property
    def bucket(self) -> str:
        """The checkpoint bucket's name."""
        return self.files.bucket

    def committed_steps(self, timeout: float = DEFAULT_PROGRESS_READ_TIMEOUT) -> dict[int, int] | None:
        """Task index -> newest committed checkpoint step (see
        :meth:`~airflow_gpu_resilience.hooks.progress.CheckpointFilesHook.committed_steps`).

        Each request of the read (the listing, each commit record) that fails for a transient
        reason (the bucket unreachable, 429, 5xx) is sent again with exponential backoff (the
        Storage client's own retry, ``google.cloud.storage.retry.DEFAULT_RETRY``: 1 s doubling
        to 60 s apart, with jitter) until ``timeout`` seconds have passed; an error that is not
        transient (403, 404) ends it at once.

        :param timeout: seconds each request may be retried for (>= 0; default
            :data:`~airflow_gpu_resilience.run_state.DEFAULT_PROGRESS_READ_TIMEOUT`).
        :return: the steps, or ``None`` when the bucket could not be read (logged).
        """
        return self.files.committed_steps(retry=DEFAULT_RETRY.with_timeout(timeout))

    def log_progress(self, run: RunState, task_count: int) -> None:
        """Read and log the tasks' ``progress.json`` (first :data:`MAX_PROGRESS_TASKS` tasks) into ``run.progress``."""
        for index in range(min(task_count or 1, MAX_PROGRESS_TASKS)):
            progress = self.files.progress(index)
            if progress is not None:
                run.progress[str(index)] = progress.to_dict()
                self.log.info("Progress %s", progress.describe())

    def lost_work(self, run: RunState, task_count: int) -> list[LostWork]:
        """Log the tasks' progress, then the work lost to each preemption (first :data:`MAX_PROGRESS_TASKS` tasks)."""
        self.log_progress(run, task_count)
        lost = [item for index in range(min(task_count, MAX_PROGRESS_TASKS)) for item in self.files.lost_work(index)]
        for item in lost:
            self.log.warning("Lost work: task %s lost %s steps (attempt %s of %s resumed from step %s)",
                             item["task_index"], item["lost_steps"], item["attempt"], item["execution"],
                             item["resumed_from_step"])
        return lost  # type: ignore[return-value]
