"""Decide what the execute operator does with a finished Cloud Run execution.

:func:`decide` turns the classified tasks of a finished execution into an :class:`Action` (the
last column of the outcome table (``docs/howto/execute-job.rst``), in :mod:`~airflow_gpu_resilience.classification`).
Pure: no I/O, no clocks. :func:`with_worker_reason` adds what the worker's own files say about a
non-retryable stop (its ``FATAL`` marker, a newer release's commit record) to a classified task,
so that the decision, and the Airflow task's error, give the worker's reason and not only an
exit code.

This module is also the one import path for the outcome API: the classification
(:mod:`~airflow_gpu_resilience.classification`) and the attempt records
(:mod:`~airflow_gpu_resilience.attempt_log`) are re-exported here.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_gpu_resilience.attempt_log import AttemptLog, AttemptRecord, observe_attempts, worker_attempt
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
    "deadline_window", "decide", "describe_task", "elapsed_seconds", "execution_state", "observe_attempts", "worker_attempt",
    "task_timeout_seconds", "REFUSAL_EXIT_CODE", "WORKER_FATAL_EXIT_CODES", "wants_worker_reason",
    "with_worker_reason",
]

#: The exit codes for which the bundled worker writes a ``FATAL`` marker with its reason in the task
#: folder: the BSD sysexits range (``docs/worker-contract.rst``, "Exit codes").
WORKER_FATAL_EXIT_CODES: frozenset[int] = frozenset(range(64, 79))
#: The worker's exit code for what it refuses to run with (``EX_CONFIG``), among them a commit
#: record a newer release of the worker wrote (the image was rolled back).
REFUSAL_EXIT_CODE = 78
#: The most characters of a worker's reason that are kept (the marker is a file in the bucket).
MAX_REASON_CHARS = 1000


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
    (the system stopping siblings of a failed task) count as INCOMPLETE. The reason of a FATAL or
    FAILED decision is the blamed task's ``reason`` (:func:`with_worker_reason`) when it has one.

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
        why = task.reason or "non-retryable exit code"
        return Decision(Action.FAIL_NO_RETRY, OutcomeClass.FATAL, f"{describe_task(task)}: {why}", task)
    if by_class[OutcomeClass.FAILED]:
        task = by_class[OutcomeClass.FAILED][0]
        why = "failed after its retries" + (f"; the worker says: {task.reason}" if task.reason else "")
        return Decision(Action.FAIL, OutcomeClass.FAILED, f"{describe_task(task)}: {why}", task)
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


def wants_worker_reason(task: TaskOutcome) -> bool:
    """Whether the worker's files may say why ``task`` stopped for good (see :func:`with_worker_reason`).

    :param task: a classified task.
    :return: ``True`` when its last attempt ended FATAL or FAILED with an exit code (not a signal)
        in :data:`WORKER_FATAL_EXIT_CODES`, for which the bundled worker writes a ``FATAL`` marker.
    """
    return (task.outcome in (OutcomeClass.FATAL, OutcomeClass.FAILED) and task.term_signal is None
            and task.exit_code in WORKER_FATAL_EXIT_CODES)


def with_worker_reason(task: TaskOutcome, marker: Any = None, newer: str | None = None) -> TaskOutcome:
    """``task`` with the worker's reason for its non-retryable stop, FATAL when a re-run can never help.

    The worker's ``FATAL`` marker (``{exit_code, reason, ..., newer_record}``, ``docs/worker-contract.rst``,
    "The task folder's contract") applies when its ``exit_code`` is the task's: its ``reason``
    becomes the task's. A task that exited :data:`REFUSAL_EXIT_CODE` (78) because its folder holds
    a commit record of a newer worker release (the marker's ``newer_record``, or ``newer`` read
    from the folder by the provider) is FATAL, whatever ``fatal_exit_codes`` says: every re-run of
    that image refuses the folder too. Without a marker that applies, ``newer`` is the reason.

    ===============================  =====================  =========  ======================
    Last attempt                     The marker             ``newer``  Result
    ===============================  =====================  =========  ======================
    not :func:`wants_worker_reason`  any                    any        unchanged
    exit 78                          with ``newer_record``  any        FATAL, its reason
    exit 78                          without                set        FATAL, its reason
    exit 78                          does not apply         set        FATAL, ``newer``
    exit 64-78                       without                unset      class kept, its reason
    exit 64-78                       does not apply         unset      unchanged
    ===============================  =====================  =========  ======================

    :param task: a classified task (:func:`classify_task`).
    :param marker: the decoded JSON of the task folder's ``FATAL`` file (anything: a malformed
        one, or one of another exit code, does not apply), ``None`` when there is none.
    :param newer: why the task folder's newest commit record is a newer release's, as the
        provider reads the folder, or ``None``.
    :return: the task, with ``reason`` (at most :data:`MAX_REASON_CHARS` characters) and class.
    """
    if not wants_worker_reason(task):
        return task
    applies = (isinstance(marker, dict) and type(marker.get("exit_code")) is int
               and marker["exit_code"] == task.exit_code and isinstance(marker.get("reason"), str)
               and marker["reason"].strip() != "")
    refusal = task.exit_code == REFUSAL_EXIT_CODE
    if applies:
        reason = marker["reason"].strip()
    else:
        reason = (newer or "") if refusal else ""
    refused = refusal and (bool(newer) or (applies and isinstance(marker.get("newer_record"), dict)))
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 3] + "..."
    return dataclasses.replace(task, reason=reason, outcome=OutcomeClass.FATAL if refused else task.outcome)
