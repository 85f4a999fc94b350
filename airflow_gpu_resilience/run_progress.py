"""A task instance's checkpoint progress, from the worker's files in the checkpoint bucket.

The run manager's reads of the bucket, through
:class:`~airflow_gpu_resilience.hooks.progress.CheckpointFilesHook` (best effort: an unreadable
file never fails the task): the newest committed checkpoint step of every task, the progress
history of the task instance's executions built from it, the tasks' ``progress.json`` lines, the
work each preemption lost, the worker's reason for a task it stopped for good (its ``FATAL``
marker, a newer release's commit record), and how an attempt that no poll saw ended (its goodput
events file).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from google.cloud import run_v2
from google.cloud.storage.retry import DEFAULT_RETRY

from airflow_gpu_resilience.attempt_log import AttemptLog, AttemptRecord, worker_attempt
from airflow_gpu_resilience.classification import task_timeout_seconds
from airflow_gpu_resilience.hooks.progress import CheckpointFilesHook
from airflow_gpu_resilience.overrides import execution_env
from airflow_gpu_resilience.outcome import (
    REFUSAL_EXIT_CODE,
    OutcomeClass,
    TaskOutcome,
    wants_worker_reason,
    with_worker_reason,
)
from airflow_gpu_resilience.rerun_budget import ExecutionProgress
from airflow_gpu_resilience.run_state import (
    DEFAULT_PROGRESS_READ_TIMEOUT,
    START_STEPS_ENV,
    LostWork,
    RunState,
    comparable_steps,
    decode_steps,
)

__all__ = ["FATAL_FILE", "MAX_PROGRESS_TASKS", "RUN_ID_ENV", "CheckpointProgress", "job_env", "progress_history",
           "run_folder"]

#: Most tasks whose progress files are read (per poll), whose lost work is reported and whose
#: ``FATAL`` marker is read (per execution).
MAX_PROGRESS_TASKS = 16
#: The worker's marker of a non-retryable error in its task folder: ``{exit_code, reason, ...}``
#: (``docs/worker-contract.rst``, "The commit record").
FATAL_FILE = "FATAL"
#: The job's env var that adds a run level to its task folders' path (the worker's ``--run-id``).
RUN_ID_ENV = "CHECKPOINT_RUN_ID"


def run_folder(job_name: str, env: Mapping[str, str]) -> str:
    """The folder of a job's task folders in the bucket, as the worker names it from its env.

    :param job_name: the job's name (the folder without a run level).
    :param env: the job's container env (its overrides applied).
    :return: ``{job_name}/{CHECKPOINT_RUN_ID}`` when that variable is set and not blank, else ``job_name``.
    """
    run_id = (env.get(RUN_ID_ENV) or "").strip().strip("/")
    return f"{job_name}/{run_id}" if run_id else job_name


def job_env(hook: Any, job_name: str, region: str, overrides: Mapping[str, Any] | None,
            project_id: str | None) -> dict[str, str]:
    """The env of a job's first container (GetJob) with ``overrides``' env on top (dict form).

    :raises google.api_core.exceptions.GoogleAPIError: the job cannot be read.
    """
    job = hook.get_job(job_name=job_name, region=region, project_id=project_id)
    containers = job.template.template.containers
    env = {e.name: e.value for e in containers[0].env} if containers else {}
    container_overrides = (overrides or {}).get("container_overrides") or [{}]
    env.update({e.get("name", ""): e.get("value", "") for e in container_overrides[0].get("env", [])})
    return env


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
    :param env: the job's env, read once, on first use (:attr:`files`), when ``prefix`` is only
        the default (the job's name); ``None``: ``prefix`` as given.
    """

    def __init__(self, files: CheckpointFilesHook, log: logging.Logger | logging.LoggerAdapter,
                 env: Callable[[], Mapping[str, str]] | None = None) -> None:
        self._files, self.log, self._env = files, log, env

    @property
    def files(self) -> CheckpointFilesHook:
        """The hook on the task folders. With ``env`` given (the prefix is the job's name, the
        default), the first use follows the job's run level (:func:`run_folder`): the worker
        writes to ``{job}/{CHECKPOINT_RUN_ID}/task-N`` when the job sets that variable."""
        if self._env is not None:
            env, self._env = self._env, None
            try:
                self._files.prefix = run_folder(self._files.prefix, env())
            except Exception as exc:  # best effort, as every read here: the job's name is the folder
                self.log.warning("Cannot read the job's CHECKPOINT_RUN_ID (%s); reading gs://%s/%s/", exc,
                                 self._files.bucket, self._files.prefix)
        return self._files

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

    def worker_reasons(self, outcomes: Sequence[TaskOutcome],
                       timeout: float = DEFAULT_PROGRESS_READ_TIMEOUT) -> list[TaskOutcome]:
        """``outcomes`` with the worker's reason for each non-retryable stop (see
        :func:`~airflow_gpu_resilience.outcome.with_worker_reason`, which also makes a refusal of
        a newer release's commit record FATAL).

        Reads the ``FATAL`` marker of the first :data:`MAX_PROGRESS_TASKS` tasks that
        :func:`~airflow_gpu_resilience.outcome.wants_worker_reason`, and, when one of them exited
        78, the task folders' commit records (one listing,
        :meth:`~airflow_gpu_resilience.hooks.progress.CheckpointFilesHook.task_checkpoints`).
        Best effort: what cannot be read leaves the task as it was.

        :param outcomes: the execution's classified tasks.
        :param timeout: seconds each request of the listing may be retried for (>= 0; default
            :data:`~airflow_gpu_resilience.run_state.DEFAULT_PROGRESS_READ_TIMEOUT`).
        :return: the tasks, in the same order.
        """
        wanting = [o for o in outcomes if wants_worker_reason(o)][:MAX_PROGRESS_TASKS]
        markers: dict[int, Any] = {o.index: self.files.read_json(o.index, FATAL_FILE) for o in wanting}
        newer: dict[int, str] = {}
        if any(o.exit_code == REFUSAL_EXIT_CODE for o in wanting):
            folders = self.files.task_checkpoints(retry=DEFAULT_RETRY.with_timeout(timeout)) or {}
            for index in markers:
                found = folders.get(index)
                if found is not None and found.newer is not None:  # "task i: " is said by the decision already
                    newer[index] = found.newer.reason(index).removeprefix(f"task {index}: ")
        return [with_worker_reason(o, markers.get(o.index), newer.get(o.index)) if o.index in markers else o
                for o in outcomes]

    def tell_unobserved(self, execution: str, attempts: AttemptLog, tasks: Sequence[run_v2.Task]) -> int:
        """Fill in the attempts of ``execution`` that no poll saw from the worker's own records.

        Cloud Run keeps each task's latest attempt result only, so an attempt that ended and was
        retried between two polls (or while the API was unreachable) is ``UNOBSERVED``; the worker
        wrote how it ended in its goodput events file (:func:`~.attempt_log.worker_attempt`).
        Reads those files only for tasks with such attempts (the first :data:`MAX_PROGRESS_TASKS`
        of them); best effort: an unreadable file leaves the attempt unobserved.

        :param execution: the execution's full name.
        :param attempts: its attempt log (changed in place).
        :param tasks: its tasks, as ListTasks returns them (for each task's timeout).
        :return: how many attempts were filled in.
        """
        indexes = sorted({record.task_index for record in attempts.unobserved()})[:MAX_PROGRESS_TASKS]
        if not indexes:
            return 0
        short = execution.rsplit("/", 1)[-1]
        timeouts = {task.index: task_timeout_seconds(task) for task in tasks}
        found: dict[tuple[int, int], AttemptRecord] = {}
        for index in indexes:
            for (name, number), events in self.files.goodput_events(index).items():
                record = worker_attempt(index, number, events, timeouts.get(index)) if name == short else None
                if record is not None:
                    found[record.key] = record
        return attempts.tell(found)
