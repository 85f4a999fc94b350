"""Decide what the execute operator does with a finished Cloud Run execution.

:func:`decide` turns the classified tasks of a finished execution into an :class:`Action` (the
last column of the README's outcome table, in :mod:`~airflow_gpu_resilience.classification`).
Pure: no I/O, no clocks.

This module is also the one import path for the outcome API: the classification
(:mod:`~airflow_gpu_resilience.classification`) and the attempt records
(:mod:`~airflow_gpu_resilience.attempt_log`) are re-exported here.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from airflow_gpu_resilience.attempt_log import AttemptLog, AttemptRecord, observe_attempts
from airflow_gpu_resilience.classification import (
    DEADLINE_WINDOW_SECONDS,
    DEFAULT_FATAL_EXIT_CODES,
    PREEMPTION_EXIT_CODES,
    PREEMPTION_SIGNALS,
    RESUMABLE,
    ExecutionState,
    OutcomeClass,
    TaskOutcome,
    classify_attempt,
    classify_attempt_result,
    classify_task,
    completed_condition,
    completion_message,
    deadline_window,
    elapsed_seconds,
    execution_state,
    task_timeout_seconds,
)

if TYPE_CHECKING:  # the progress rule builds on this module's types
    from airflow_gpu_resilience.rerun_budget import ProgressBudget

__all__ = [
    "DEADLINE_WINDOW_SECONDS", "DEFAULT_FATAL_EXIT_CODES", "PREEMPTION_EXIT_CODES", "PREEMPTION_SIGNALS", "RESUMABLE",
    "Action", "AttemptLog", "AttemptRecord", "Decision", "ExecutionState", "OutcomeClass", "TaskOutcome",
    "classify_attempt", "classify_attempt_result", "classify_task", "completed_condition", "completion_message",
    "deadline_window", "decide", "describe_task", "elapsed_seconds", "execution_state", "observe_attempts",
    "task_timeout_seconds",
]


class Action(str, enum.Enum):
    """What the execute operator does with a finished execution."""

    SUCCEED = "SUCCEED"
    RERUN = "RERUN"
    FAIL = "FAIL"
    """Fail the Airflow task; Airflow's own ``retries`` apply."""
    FAIL_NO_RETRY = "FAIL_NO_RETRY"
    """Fail the Airflow task without retry (FATAL, CANCELLED, budget exhausted)."""


@dataclass(frozen=True)
class Decision:
    """What to do with a finished execution, and why.

    :param action: the operator's next step.
    :param outcome: the execution's overall class.
    :param reason: one sentence for logs and exception messages.
    :param blamed: the task that decided the outcome, or ``None`` (success, cancellation).
    """

    action: Action
    outcome: OutcomeClass
    reason: str
    blamed: TaskOutcome | None = field(default=None)


def decide(
    tasks: Sequence[TaskOutcome],
    *,
    state: ExecutionState,
    reruns_used: int,
    max_reruns: int,
    progress: ProgressBudget | None = None,
) -> Decision:
    """Decide what to do with a finished execution.

    Precedence: a user cancellation > any FATAL task > any FAILED task > any PREEMPTED/TIMED_OUT
    task (re-run while the budget lasts) > success. Tasks CANCELLED while the execution was not
    (the system stopping siblings of a failed task) count as INCOMPLETE.

    The budget of a PREEMPTED/TIMED_OUT execution: with ``progress`` (a checkpoint bucket) the rule
    of :func:`~airflow_gpu_resilience.rerun_budget.decide_rerun`; without, the fixed budget
    ``reruns_used < max_reruns``.

    :param tasks: every task of the execution, classified by :func:`classify_task`.
    :param state: the execution's coarse state (:func:`execution_state`); must not be RUNNING.
    :param reruns_used: re-runs (new executions) already started for this Airflow task.
    :param max_reruns: the fixed preemption budget (re-runs allowed in total), used without ``progress``.
    :param progress: the checkpoint progress of every execution of the Airflow task
        (:class:`~airflow_gpu_resilience.rerun_budget.ProgressBudget`), or ``None``.
    :return: the decision.
    :raises ValueError: if ``state`` is RUNNING.
    """
    if state is ExecutionState.RUNNING:
        raise ValueError("decide() needs a finished execution, got state RUNNING")
    if state is ExecutionState.CANCELLED:
        return Decision(Action.FAIL_NO_RETRY, OutcomeClass.CANCELLED, "the execution was cancelled")
    by_class = {c: [t for t in tasks if t.outcome is c] for c in OutcomeClass}
    if by_class[OutcomeClass.FATAL]:
        task = by_class[OutcomeClass.FATAL][0]
        return Decision(Action.FAIL_NO_RETRY, OutcomeClass.FATAL, f"{describe_task(task)}: non-retryable exit code", task)
    if by_class[OutcomeClass.FAILED]:
        task = by_class[OutcomeClass.FAILED][0]
        return Decision(Action.FAIL, OutcomeClass.FAILED, f"{describe_task(task)}: failed after its retries", task)
    resumable = by_class[OutcomeClass.PREEMPTED] + by_class[OutcomeClass.TIMED_OUT]
    if resumable:
        if progress is not None:
            return progress.decide(resumable[0], reruns_used)
        return _decide_resumable(resumable[0], reruns_used, max_reruns)
    if state is ExecutionState.SUCCEEDED or (tasks and len(by_class[OutcomeClass.SUCCEEDED]) == len(tasks)):
        return Decision(Action.SUCCEED, OutcomeClass.SUCCEEDED, "all tasks succeeded")
    return Decision(
        Action.FAIL,
        OutcomeClass.FAILED,
        f"the execution ended {state.value} without a task to blame "
        f"({', '.join(f'task {t.index}: {t.outcome.value}' for t in tasks) or 'no tasks'})",
    )


def _decide_resumable(task: TaskOutcome, reruns_used: int, max_reruns: int) -> Decision:
    what = "preempted" if task.outcome is OutcomeClass.PREEMPTED else "timed out"
    if reruns_used < max_reruns:
        return Decision(
            Action.RERUN,
            task.outcome,
            f"{describe_task(task)}: {what}; re-run {reruns_used + 1} of {max_reruns} resumes from the checkpoint",
            task,
        )
    return Decision(
        Action.FAIL_NO_RETRY,
        task.outcome,
        f"{describe_task(task)}: {what}; preemption budget exhausted ({max_reruns} re-runs used)",
        task,
    )


def describe_task(task: TaskOutcome) -> str:
    """``"task 0 attempt 2 (exit code 143, 'message')"``: a classified task for decisions' reasons.

    :param task: the task's classified last attempt.
    """
    how = f"signal {task.term_signal}" if task.term_signal else f"exit code {task.exit_code}"
    text = f"task {task.index} attempt {task.attempts} ({how}"
    if task.message:
        text += f", {task.message!r}"
    return text + ")"
