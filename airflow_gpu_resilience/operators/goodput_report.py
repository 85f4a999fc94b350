"""Build the goodput account of an execute-operator run from Cloud Run's tasks and the worker's files.

The glue between :mod:`airflow_gpu_resilience.goodput` (pure) and the hooks: Cloud Run gives
each task's attempt count (``retried`` + 1), its ``scheduled_time`` and its latest attempt's
``start_time``/``completion_time`` (earlier attempts of the same execution keep no times in the
API: the account places them between their neighbours and bills them); the worker's
``goodput-{execution}-{attempt}.json`` gives the rest. Best effort: a read that fails leaves the
attempt's events out, it never fails the task.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from google.cloud import run_v2

from airflow_gpu_resilience.goodput import AttemptInput, GoodputAccount, account_task, describe, format_table, total
from airflow_gpu_resilience.hooks.progress import CheckpointFilesHook


class GoodputReport(TypedDict):
    """The summary's ``goodput``: per-task accounts, their total, the logged table and its one-line
    ``headline`` (:func:`~airflow_gpu_resilience.goodput.describe`, also in a failure's message)."""

    tasks: list[GoodputAccount]
    total: GoodputAccount
    table: str
    headline: str


def _epoch(value: Any) -> float | None:
    return value.timestamp() if value else None


def gpus_per_task(task: run_v2.Task) -> int:
    """GPUs of one task instance: the sum of its containers' ``nvidia.com/gpu`` limits (0 if none)."""
    count = 0
    for container in task.containers:
        try:
            count += int(container.resources.limits.get("nvidia.com/gpu", "0"))
        except ValueError:
            continue
    return count


def attempt_inputs(
    executions: Sequence[tuple[str, Sequence[run_v2.Task]]],
    events: Mapping[int, Mapping[tuple[str, int], Mapping[str, Any]]],
) -> dict[int, list[AttemptInput]]:
    """Every attempt of every task index, with the platform's times where it gives them.

    :param executions: ``(full execution name, its tasks)`` in run order.
    :param events: task index -> ``(execution short id, attempt)`` -> the worker's events.
    :return: task index -> its attempts (attempts ``0..retried`` of each execution), each with
        its task's ``scheduled_time`` (else ``create_time``) in that execution as ``scheduled``.
    """
    inputs: dict[int, list[AttemptInput]] = {}
    for name, tasks in executions:
        short = name.rsplit("/", 1)[-1]
        for task in tasks:
            found = events.get(task.index, {})
            last = int(task.retried)
            scheduled = _epoch(task.scheduled_time) or _epoch(task.create_time)
            for attempt in range(last + 1):
                platform = attempt == last and task.start_time
                inputs.setdefault(task.index, []).append(AttemptInput(
                    execution=short, attempt=attempt,
                    start=_epoch(task.start_time) if platform else None,
                    end=_epoch(task.completion_time) if platform else None,
                    events=found.get((short, attempt)), scheduled=scheduled,
                ))
    return inputs


def build_report(
    executions: Sequence[tuple[str, Sequence[run_v2.Task]]], files: CheckpointFilesHook | None, max_tasks: int,
    unfinished: bool = False,
) -> GoodputReport:
    """The goodput report of a run.

    :param executions: ``(full execution name, its tasks)`` in run order (finished executions, or
        one still stopping: a task without a completion time ends at the worker's last write).
    :param files: the worker's files (``None``: no bucket, platform times only: all start-up).
    :param max_tasks: most task indexes whose files are read.
    :param unfinished: the Airflow task failed: each task's steps past its newest committed
        checkpoint (read from the bucket) are wasted (see ``durable_step`` of
        :func:`~airflow_gpu_resilience.goodput.account_task`); not when the bucket is unreadable.
    :return: the report (accounts in task-index order).
    """
    indexes = sorted({t.index for _, tasks in executions for t in tasks})
    events = {i: files.goodput_events(i) for i in indexes[:max_tasks]} if files is not None else {}
    durable = files.committed_steps() if unfinished and files is not None else None
    gpus = max((gpus_per_task(t) for _, tasks in executions for t in tasks), default=0)
    accounts = [account_task(i, attempts, gpus_per_task=gpus,
                             durable_step=None if durable is None else durable.get(i, 0))
                for i, attempts in sorted(attempt_inputs(executions, events).items())]
    return GoodputReport(tasks=accounts, total=total(accounts), table=format_table(accounts),
                         headline=describe(accounts))
