"""Classify Cloud Run task attempts, tasks and executions.

Pure functions over ``run_v2`` messages and primitives: no I/O, no clocks. The classes are those
of the outcome table (``docs/howto/execute-job.rst``) (the action is :func:`~airflow_gpu_resilience.outcome.decide`'s):

============  ==========================================================  ======================
Class         Last attempt looks like                                     Operator action
============  ==========================================================  ======================
SUCCEEDED     exit 0 (status OK)                                          done
PREEMPTED     exit 143 or 137, or termSignal 15/9 not for memory, or a    re-run from checkpoint
              maintenance-preemption status message                       (preemption budget)
TIMED_OUT     the attempt hit the task timeout                            re-run (same budget)
FAILED        any other non-zero exit, including out of memory            fail; Airflow retries
FATAL         exit code in the non-retryable set (default 64-78)          fail, no retry
CANCELLED     status CANCELLED (a user, ``on_kill``), even with the exit  fail, no re-run
              143 or signal 15 the stop leaves
============  ==========================================================  ======================

Two helper classes complete the picture: RUNNING (not finished yet) and INCOMPLETE (a task that
never ran to an end because its execution stopped early, e.g. siblings cancelled by the system).

What Cloud Run shows for a preemption is not part of the API schema (``docs/emulator.rst``, "Known
differences from Cloud Run" lists what the emulator infers), so detection uses every trace it
leaves.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from google.cloud import run_v2

#: BSD sysexits range: configuration or input errors that retrying cannot fix.
DEFAULT_FATAL_EXIT_CODES: frozenset[int] = frozenset(range(64, 79))
#: Exit codes of a process stopped by SIGTERM (143 = 128+15) or SIGKILL through a shell (137).
PREEMPTION_EXIT_CODES: frozenset[int] = frozenset({143, 137})
#: Termination signals the platform uses to stop a container (SIGTERM, SIGKILL).
PREEMPTION_SIGNALS: frozenset[int] = frozenset({15, 9})

# google.rpc.Code values seen in lastAttemptResult.status.
_CODE_OK = 0
_CODE_CANCELLED = 1
CODE_UNKNOWN = 2
_CODE_DEADLINE_EXCEEDED = 4

_MAINTENANCE_RE = re.compile(r"preempt|maintenance", re.IGNORECASE)
_TIMEOUT_RE = re.compile(r"timeout|timed out|deadline exceeded", re.IGNORECASE)
_MEMORY_RE = re.compile(r"memory limit|out of memory|\boom\b|oomkill", re.IGNORECASE)


class OutcomeClass(str, enum.Enum):
    """How one task (or a whole execution) ended."""

    SUCCEEDED = "SUCCEEDED"
    PREEMPTED = "PREEMPTED"
    TIMED_OUT = "TIMED_OUT"
    FAILED = "FAILED"
    FATAL = "FATAL"
    CANCELLED = "CANCELLED"
    RUNNING = "RUNNING"
    INCOMPLETE = "INCOMPLETE"
    UNOBSERVED = "UNOBSERVED"
    """An attempt that ended and was retried before any poll saw its result: the API keeps only
    the last attempt's ``last_attempt_result``, so its cause is unknown; a retried attempt is a
    failed one. Only ever the class of an
    :class:`~airflow_gpu_resilience.attempt_log.AttemptRecord`, never of a task."""


#: Classes that a new execution can fix by resuming from the checkpoint.
RESUMABLE: frozenset[OutcomeClass] = frozenset({OutcomeClass.PREEMPTED, OutcomeClass.TIMED_OUT})





class ExecutionState(str, enum.Enum):
    """Coarse state of an execution as reported by the API."""

    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


@dataclass(frozen=True)
class TaskOutcome:
    """The classified last attempt of one task.

    :param index: task index within the execution (0-based).
    :param attempts: attempts made so far (``retried + 1``; 0 if it never started).
    :param outcome: the class of the last attempt.
    :param exit_code: exit code of the last attempt, ``None`` when it died by signal or never ran.
    :param term_signal: terminating signal of the last attempt, or ``None``.
    :param status_code: ``google.rpc.Code`` of the last attempt's status.
    :param message: the last attempt's status message.
    :param log_uri: the task's log URI (may be empty).
    :param reason: why the worker says it stopped for good, from its own files in the checkpoint
        bucket (:func:`~airflow_gpu_resilience.outcome.with_worker_reason`); ``""`` when they say nothing.
    """

    index: int
    attempts: int
    outcome: OutcomeClass
    exit_code: int | None = None
    term_signal: int | None = None
    status_code: int = 0
    message: str = ""
    log_uri: str = ""
    reason: str = ""

    def to_dict(self) -> dict[str, object]:
        """JSON-able form for XCom and trigger events (``reason`` only when there is one)."""
        return {
            "index": self.index,
            "attempts": self.attempts,
            "outcome": self.outcome.value,
            "exit_code": self.exit_code,
            "term_signal": self.term_signal,
            "status_code": self.status_code,
            "message": self.message,
            "log_uri": self.log_uri,
            **({"reason": self.reason} if self.reason else {}),
        }




def classify_attempt(
    *,
    exit_code: int | None,
    term_signal: int | None,
    status_code: int = 0,
    message: str = "",
    fatal_exit_codes: Collection[int] = DEFAULT_FATAL_EXIT_CODES,
    duration_seconds: float | None = None,
    timeout_seconds: float | None = None,
) -> OutcomeClass:
    """Classify one finished task attempt from its primitive result fields.

    Precedence: out-of-memory (FAILED, even when killed by SIGKILL) > a FATAL exit code > a task
    timeout > success > a cancelled status (``google.rpc.Code`` 1) without a maintenance message >
    a preemption trace > FAILED. A cancelled attempt also ends by SIGTERM (exit 143, signal 15),
    so the status, not the exit code, tells it from a preemption.

    A task timeout is also an exit 143 the worker made itself (no signal, no maintenance message)
    within :func:`deadline_window` of the task timeout: the worker's deadline-aware exit
    (``TASK_TIMEOUT_SECONDS``) checkpoints and stops shortly *before* Cloud Run would, so Cloud
    Run reports a plain exit 143. Both classes are re-run the same way.

    :param exit_code: the container's exit code, ``None`` when unset (signal death or no start).
    :param term_signal: the signal that terminated the container, ``None`` or 0 when unset.
    :param status_code: ``google.rpc.Code`` of the attempt's status (0 = OK).
    :param message: the status message.
    :param fatal_exit_codes: exit codes that must not be retried (default 64-78).
    :param duration_seconds: the attempt's start to its end, in seconds, when known.
    :param timeout_seconds: the task timeout of the attempt, in seconds, when known.
    :return: the attempt's class (never RUNNING or INCOMPLETE).
    """
    signal = term_signal or None
    if _MEMORY_RE.search(message):
        return OutcomeClass.FAILED
    if exit_code is not None and exit_code in fatal_exit_codes:
        return OutcomeClass.FATAL
    if status_code == _CODE_DEADLINE_EXCEEDED or _TIMEOUT_RE.search(message):
        return OutcomeClass.TIMED_OUT
    if status_code == _CODE_OK and not exit_code and signal is None:
        return OutcomeClass.SUCCEEDED
    # A cancellation stops the container with SIGTERM too, so it leaves exit 143 or signal 15:
    # the CANCELLED status decides, unless the message names a maintenance preemption.
    if status_code == _CODE_CANCELLED and not _MAINTENANCE_RE.search(message):
        return OutcomeClass.CANCELLED
    if (
        exit_code == 143 and signal is None and not _MAINTENANCE_RE.search(message)
        and duration_seconds is not None and timeout_seconds
        and duration_seconds >= timeout_seconds - deadline_window(timeout_seconds)
    ):
        return OutcomeClass.TIMED_OUT
    if (
        exit_code in PREEMPTION_EXIT_CODES
        or signal in PREEMPTION_SIGNALS
        or _MAINTENANCE_RE.search(message)
    ):
        return OutcomeClass.PREEMPTED
    if status_code == _CODE_CANCELLED:
        return OutcomeClass.CANCELLED
    return OutcomeClass.FAILED


#: Seconds before the task timeout within which a worker's own exit 143 counts as TIMED_OUT, at
#: most: the worker stops ``min(PREEMPTION_GRACE_SECONDS, timeout / 2)`` before the timeout
#: (grace 10 s by default), plus its final save, its exit and the platform's bookkeeping.
DEADLINE_WINDOW_SECONDS = 30.0


def deadline_window(timeout_seconds: float) -> float:
    """Seconds before a task timeout of ``timeout_seconds`` in which an exit 143 is a deadline stop.

    :param timeout_seconds: the task timeout (> 0), in seconds.
    :return: ``min(DEADLINE_WINDOW_SECONDS, timeout_seconds / 2 + 1)``.
    """
    return min(DEADLINE_WINDOW_SECONDS, timeout_seconds / 2 + 1.0)


def classify_attempt_result(
    result: run_v2.TaskAttemptResult,
    fatal_exit_codes: Collection[int] = DEFAULT_FATAL_EXIT_CODES,
    duration_seconds: float | None = None,
    timeout_seconds: float | None = None,
) -> OutcomeClass:
    """Classify a ``run_v2.TaskAttemptResult`` (see :func:`classify_attempt`).

    :param result: the task's ``last_attempt_result``.
    :param fatal_exit_codes: exit codes that must not be retried (default 64-78).
    :param duration_seconds: the attempt's duration in seconds, when known.
    :param timeout_seconds: its task timeout in seconds, when known.
    :return: the attempt's class.
    """
    exit_code, signal = exit_and_signal(result)
    return classify_attempt(
        exit_code=exit_code,
        term_signal=signal,
        status_code=result.status.code,
        message=result.status.message,
        fatal_exit_codes=fatal_exit_codes,
        duration_seconds=duration_seconds,
        timeout_seconds=timeout_seconds,
    )


def task_timeout_seconds(task: run_v2.Task) -> float | None:
    """The task's attempt timeout in seconds, or ``None`` when the API did not set it."""
    return task.timeout.total_seconds() if "timeout" in task else None


def exit_and_signal(result: run_v2.TaskAttemptResult) -> tuple[int | None, int | None]:
    """``(exit code, signal)`` of an attempt result: at most one of exitCode and termSignal is set;
    a signal means no exit code.

    :param result: a task's ``last_attempt_result``.
    :return: ``(None, signal)`` when a signal ended it, else ``(exit code, None)``.
    """
    signal = result.term_signal or None
    return (None if signal else result.exit_code), signal


def completed_condition(conditions: Iterable[run_v2.Condition]) -> run_v2.Condition | None:
    """The ``Completed`` condition of a task or an execution.

    :param conditions: the resource's ``conditions``.
    :return: the condition, or ``None`` while the API has not set it.
    """
    for condition in conditions:
        if condition.type_ == "Completed":
            return condition
    return None


def completion_message(execution: run_v2.Execution) -> str:
    """The message of an execution's ``Completed`` condition (``""`` when it has none).

    :param execution: the execution as GetExecution returns it.
    """
    completed = completed_condition(execution.conditions)
    return completed.message if completed is not None else ""


def elapsed_seconds(resource: run_v2.Task | run_v2.Execution) -> float | None:
    """Seconds from ``start_time`` to ``completion_time`` of a task or an execution, to 1 ms.

    :param resource: a task (its latest attempt) or an execution.
    :return: the duration (never negative), or ``None`` unless both times are set.
    """
    if not (resource.start_time and resource.completion_time):
        return None
    return round(max(0.0, (resource.completion_time - resource.start_time).total_seconds()), 3)


_TERMINAL_STATES = (run_v2.Condition.State.CONDITION_SUCCEEDED, run_v2.Condition.State.CONDITION_FAILED)
_CANCEL_REASONS = (run_v2.Condition.ExecutionReason.CANCELLED, run_v2.Condition.ExecutionReason.CANCELLING)


def classify_task(
    task: run_v2.Task,
    fatal_exit_codes: Collection[int] = DEFAULT_FATAL_EXIT_CODES,
) -> TaskOutcome:
    """Classify a task from its ``Completed`` condition and ``last_attempt_result``.

    A task without a terminal ``Completed`` condition and without ``completion_time`` is
    RUNNING. A finished task whose condition says it was cancelled, or that never produced an
    attempt result, is CANCELLED or INCOMPLETE respectively; the execution decides whether that
    cancellation was a user's (see :func:`~airflow_gpu_resilience.outcome.decide`).

    :param task: the task as ListTasks/GetTask returns it.
    :param fatal_exit_codes: exit codes that must not be retried (default 64-78).
    :return: the classified task.
    """
    completed = completed_condition(task.conditions)
    terminal = (completed is not None and completed.state in _TERMINAL_STATES) or bool(
        task.completion_time
    )
    has_result = "last_attempt_result" in task
    result = task.last_attempt_result
    exit_code, signal = exit_and_signal(result) if has_result else (None, None)
    started = has_result or bool(task.start_time) or task.retried > 0
    if not terminal:
        outcome = OutcomeClass.RUNNING
    elif completed is not None and completed.execution_reason in _CANCEL_REASONS:
        outcome = OutcomeClass.CANCELLED
    elif not has_result:
        outcome = OutcomeClass.INCOMPLETE
    else:
        outcome = classify_attempt_result(result, fatal_exit_codes, elapsed_seconds(task), task_timeout_seconds(task))
    return TaskOutcome(
        index=task.index,
        attempts=task.retried + 1 if started else 0,
        outcome=outcome,
        exit_code=exit_code,
        term_signal=signal,
        status_code=result.status.code if has_result else 0,
        message=result.status.message if has_result else (completed.message if completed else ""),
        log_uri=task.log_uri,
    )


def execution_state(execution: run_v2.Execution) -> ExecutionState:
    """Coarse state of an execution from its ``Completed`` condition and task counters.

    :param execution: the execution as GetExecution returns it.
    :return: RUNNING until the execution is terminal; then SUCCEEDED, FAILED or CANCELLED.
    """
    completed = completed_condition(execution.conditions)
    counted = execution.succeeded_count + execution.failed_count + execution.cancelled_count
    terminal = (completed is not None and completed.state in _TERMINAL_STATES) or (
        bool(execution.completion_time) and counted >= execution.task_count
    )
    if not terminal:
        return ExecutionState.RUNNING
    if completed is not None and completed.execution_reason in _CANCEL_REASONS:
        return ExecutionState.CANCELLED
    if execution.succeeded_count >= execution.task_count and execution.failed_count == 0:
        return ExecutionState.SUCCEEDED
    if execution.failed_count == 0 and execution.cancelled_count > 0:
        return ExecutionState.CANCELLED
    return ExecutionState.FAILED
