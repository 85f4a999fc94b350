"""The finished attempts of an execution, each recorded once, as polls see them.

The API keeps only the last attempt's result per task: :func:`observe_attempts` turns what each
poll shows into :class:`AttemptRecord` entries (an attempt retried between two polls is recorded
as ``UNOBSERVED``), and :class:`AttemptLog` accumulates them for the hook's blocking wait, the
trigger and the operator's final look at the tasks. Pure: no I/O, no clocks.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from google.cloud import run_v2

from airflow_gpu_resilience.classification import (
    CODE_UNKNOWN,
    DEFAULT_FATAL_EXIT_CODES,
    OutcomeClass,
    classify_attempt,
    classify_task,
    elapsed_seconds,
    exit_and_signal,
    task_timeout_seconds,
)

__all__ = ["AttemptLog", "AttemptRecord", "observe_attempts"]


@dataclass(frozen=True)
class AttemptRecord:
    """Raw facts of one finished task attempt, as seen while polling (JSON-able).

    :param task_index: task index within the execution.
    :param attempt: 0-based attempt number (``CLOUD_RUN_TASK_ATTEMPT`` of that attempt).
    :param exit_code: exit code, or ``None`` when the attempt died by signal.
    :param term_signal: terminating signal, or ``None``.
    :param status_code: ``google.rpc.Code`` of the attempt's status (0 = OK).
    :param message: the attempt's status message.
    :param duration_seconds: seconds from the attempt's start to the task's completion, known
        only for the last attempt of a finished task (the API keeps one ``start_time`` per task,
        that of its latest attempt); ``None`` otherwise.
    :param timeout_seconds: the task timeout in seconds, when known (see :func:`classify_attempt`).
    :param observed: ``False`` for an attempt whose result no poll saw (a later attempt's result
        had replaced it): its result fields are unset and it classes as ``UNOBSERVED``.
    """

    task_index: int
    attempt: int
    exit_code: int | None
    term_signal: int | None
    status_code: int
    message: str
    duration_seconds: float | None = None
    timeout_seconds: float | None = None
    observed: bool = True

    @classmethod
    def unobserved(cls, task_index: int, attempt: int) -> AttemptRecord:
        """The record of an attempt that ended unseen (see :attr:`OutcomeClass.UNOBSERVED`)."""
        return cls(task_index, attempt, None, None, CODE_UNKNOWN,
                   "ended and was retried before a poll saw its result", observed=False)

    @property
    def key(self) -> tuple[int, int]:
        """``(task_index, attempt)``: identifies the attempt within its execution."""
        return (self.task_index, self.attempt)

    def classify(self, fatal_exit_codes: Collection[int] = DEFAULT_FATAL_EXIT_CODES) -> OutcomeClass:
        """The attempt's class (see :func:`classify_attempt`); ``UNOBSERVED`` when no poll saw it."""
        if not self.observed:
            return OutcomeClass.UNOBSERVED
        return classify_attempt(
            exit_code=self.exit_code,
            term_signal=self.term_signal,
            status_code=self.status_code,
            message=self.message,
            fatal_exit_codes=fatal_exit_codes,
            duration_seconds=self.duration_seconds,
            timeout_seconds=self.timeout_seconds,
        )

    def to_dict(self) -> dict[str, object]:
        """JSON-able form (for trigger events)."""
        return {
            "task_index": self.task_index,
            "attempt": self.attempt,
            "exit_code": self.exit_code,
            "term_signal": self.term_signal,
            "status_code": self.status_code,
            "message": self.message,
            "duration_seconds": self.duration_seconds,
            "timeout_seconds": self.timeout_seconds,
            "observed": self.observed,
        }

    @classmethod
    def from_dict(cls, data: dict) -> AttemptRecord:
        """Inverse of :meth:`to_dict`."""
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def observe_attempts(tasks: Iterable[run_v2.Task], seen: Collection[tuple[int, int]] = ()) -> list[AttemptRecord]:
    """Finished attempts visible in ``tasks`` that are not in ``seen``.

    ``last_attempt_result`` belongs to attempt ``retried`` once the task is finished, and to
    attempt ``retried - 1`` while a retry is pending or running. The API keeps no other attempt's
    result, so an attempt that ended and was retried between two polls is gone by the second:
    it is still recorded, once, as an :meth:`AttemptRecord.unobserved` one (class
    ``UNOBSERVED``), so that every attempt Cloud Run made is accounted for, in order, whatever
    the poll interval. The final attempt is always visible.

    :param tasks: the execution's tasks, as ListTasks returns them.
    :param seen: ``(task_index, attempt)`` keys already recorded.
    :return: new records, in task-index order.
    """
    records = []
    for task in tasks:
        if "last_attempt_result" not in task:
            continue
        finished = classify_task(task).outcome is not OutcomeClass.RUNNING
        attempt = task.retried if finished else task.retried - 1
        if attempt < 0:
            continue
        records.extend(AttemptRecord.unobserved(task.index, earlier) for earlier in range(attempt)
                       if (task.index, earlier) not in seen)
        if (task.index, attempt) in seen:
            continue
        exit_code, signal = exit_and_signal(task.last_attempt_result)
        status = task.last_attempt_result.status
        duration = elapsed_seconds(task) if finished else None
        records.append(AttemptRecord(task.index, attempt, exit_code, signal, status.code, status.message, duration,
                                     task_timeout_seconds(task)))
    return sorted(records, key=lambda r: r.key)


class AttemptLog:
    """The finished attempts of one execution, each recorded once, in the order they were seen.

    The one place where polls accumulate attempts: the hook's blocking wait, the trigger and the
    operator's final look at the tasks all call :meth:`observe`.

    :param records: attempts already recorded (e.g. from a trigger event), default none.
    """

    def __init__(self, records: Iterable[AttemptRecord] = ()) -> None:
        self.records: list[AttemptRecord] = []
        self._seen: set[tuple[int, int]] = set()
        self._add(records)

    def _add(self, records: Iterable[AttemptRecord]) -> None:
        for record in records:
            if record.key not in self._seen:
                self._seen.add(record.key)
                self.records.append(record)

    def observe(self, tasks: Iterable[run_v2.Task]) -> list[AttemptRecord]:
        """Record the finished attempts in ``tasks`` not seen before (see :func:`observe_attempts`).

        :param tasks: the execution's tasks, as ListTasks returns them.
        :return: the new records, in task-index order.
        """
        new = observe_attempts(tasks, self._seen)
        self._add(new)
        return new

    def to_dicts(self, limit: int | None = None) -> list[dict[str, object]]:
        """JSON-able records (:meth:`AttemptRecord.to_dict`), the first ``limit`` when given."""
        return [record.to_dict() for record in self.records[:limit]]

    @classmethod
    def from_dicts(cls, items: Iterable[dict]) -> AttemptLog:
        """Inverse of :meth:`to_dicts`."""
        return cls(AttemptRecord.from_dict(item) for item in items)
