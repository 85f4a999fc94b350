"""The finished attempts of an execution, each recorded once, as polls see them.

The API keeps only the last attempt's result per task: :func:`observe_attempts` turns what each
poll shows into :class:`AttemptRecord` entries (an attempt retried between two polls is recorded
as ``UNOBSERVED``), and :class:`AttemptLog` accumulates them for the hook's blocking wait, the
trigger and the operator's final look at the tasks. Where the worker recorded how an unobserved
attempt ended (its goodput events file), :func:`worker_attempt` makes its record from that.
Pure: no I/O, no clocks.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
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

__all__ = ["AttemptLog", "AttemptRecord", "observe_attempts", "worker_attempt"]


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
        had replaced it) and that no worker record told: its result fields are unset and it
        classes as ``UNOBSERVED``.
    :param source: where the result comes from: ``"api"`` (a poll of Cloud Run's API, default)
        or ``"worker"`` (the worker's own record of an attempt no poll saw, :func:`worker_attempt`).
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
    source: str = "api"

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
            "source": self.source,
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


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def worker_attempt(task_index: int, attempt: int, events: Mapping[str, object],
                   timeout_seconds: float | None = None) -> AttemptRecord | None:
    """The record of an attempt no poll saw, from the worker's own goodput events file of it.

    The bundled worker (and every way into the worker library) writes, per attempt, a file with
    its ``status`` (``preempted``, ``completed``, ``failed``), the ``exit_code`` it exits with,
    ``process_start`` and ``ended_at`` (epoch seconds). Cloud Run's exit code of such an attempt
    is the worker's own (it exits 143 after a SIGTERM), so the attempt classes as a poll would
    have classed it (:func:`~airflow_gpu_resilience.classification.classify_attempt`: a
    preemption, or a task timeout when it ended within the deadline window), with status code 2
    (unknown) and no maintenance message.

    :param task_index: the attempt's task index.
    :param attempt: its 0-based attempt number.
    :param events: the parsed events file (a JSON object).
    :param timeout_seconds: the task timeout in seconds, when known.
    :return: the record (``source`` ``"worker"``), or ``None`` when the file gives no integer
        ``exit_code`` (a process killed before it recorded its end).
    """
    code = events.get("exit_code")
    if not isinstance(code, int) or isinstance(code, bool):
        return None
    start, end = _number(events.get("process_start")), _number(events.get("ended_at"))
    duration = end - start if start is not None and end is not None and end >= start else None
    # the status word stays out of the message: "preempted" would read as a maintenance message
    message = f"not seen by a poll (Cloud Run keeps a task's latest result only); the worker recorded exit code {code}"
    return AttemptRecord(task_index, attempt, code, None, CODE_UNKNOWN, message, duration, timeout_seconds,
                         source="worker")


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

    def unobserved(self) -> list[AttemptRecord]:
        """The records of attempts that ended unseen (``observed`` false), in order."""
        return [record for record in self.records if not record.observed]

    def tell(self, found: Mapping[tuple[int, int], AttemptRecord]) -> int:
        """Replace unobserved records by ``found`` ones of the same ``(task_index, attempt)``.

        :param found: records by key, e.g. from :func:`worker_attempt`; others are ignored.
        :return: how many were replaced.
        """
        replaced = 0
        for position, record in enumerate(self.records):
            if not record.observed and record.key in found:
                self.records[position] = found[record.key]
                replaced += 1
        return replaced

    def to_dicts(self, limit: int | None = None) -> list[dict[str, object]]:
        """JSON-able records (:meth:`AttemptRecord.to_dict`), the first ``limit`` when given."""
        return [record.to_dict() for record in self.records[:limit]]

    @classmethod
    def from_dicts(cls, items: Iterable[dict]) -> AttemptLog:
        """Inverse of :meth:`to_dicts`."""
        return cls(AttemptRecord.from_dict(item) for item in items)
