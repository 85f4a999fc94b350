"""The state of one execute-operator run: what it carries, what it returns, what it keeps on Cloud Run.

- The container env vars that keep a task instance's record on its executions
  (:data:`RUN_KEY_ENV`, :data:`RERUN_ENV`, :data:`START_STEPS_ENV`), so that every try reads the
  same history from Cloud Run.
- The typed summary the execute operator returns (its ``return_value`` XCom): :class:`RunSummary`
  and its parts.
- :class:`RunSettings`, the execute operator's checked arguments that the run manager acts on.
- :class:`RunState`, what one try carries from execution to execution (and through the trigger as
  its ``carry``), and :class:`RunStep`, where the run stands after an execution was acted on.

Pure: no I/O, no Airflow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

from google.cloud import run_v2

from airflow_gpu_resilience.operators.goodput_report import GoodputReport
from airflow_gpu_resilience.outcome import (
    DEFAULT_FATAL_EXIT_CODES,
    RESUMABLE,
    AttemptLog,
    Decision,
    OutcomeClass,
    TaskOutcome,
    elapsed_seconds,
    execution_state,
)
from airflow_gpu_resilience.rerun_budget import (
    DEFAULT_MAX_RERUNS_WITHOUT_PROGRESS,
    DEFAULT_MAX_TOTAL_RERUNS,
    ExecutionProgress,
)
from airflow_gpu_resilience.run_carry import add_task_attempts, bound_attempts, compact_executions, upgrade

__all__ = [
    "RERUN_ENV",
    "RUN_KEY_ENV",
    "DEFAULT_PROGRESS_READ_TIMEOUT",
    "START_STEPS_ENV",
    "AttemptEntry",
    "ChainEntry",
    "ExecutionEntry",
    "LostWork",
    "RunSettings",
    "RunState",
    "RunStep",
    "RunSummary",
    "TaskSummary",
    "chain_entries",
    "comparable_steps",
    "decode_steps",
    "encode_steps",
]

#: Container env var that marks an execution with the Airflow task instance that started it.
RUN_KEY_ENV = "AIRFLOW_GPU_RESILIENCE_RUN_KEY"
#: Container env var: ``0`` for a try's first execution, ``n`` for the n-th preemption re-run.
RERUN_ENV = "AIRFLOW_GPU_RESILIENCE_RERUN"
#: Container env var: the newest committed checkpoint step of each task when the execution was
#: started (``"0=40,1=38"``; a task without a checkpoint is left out; ``"sum=N"`` when the list
#: would be longer than :data:`MAX_START_STEPS_CHARS`). Set only with ``checkpoint_bucket``; it
#: keeps the progress record in Cloud Run, so that every try reads the same history.
START_STEPS_ENV = "AIRFLOW_GPU_RESILIENCE_START_STEPS"
#: Longest per-task form of :data:`START_STEPS_ENV` (characters) before the sum is kept instead.
MAX_START_STEPS_CHARS = 4096


def encode_steps(steps: Mapping[int, int]) -> str:
    """:data:`START_STEPS_ENV`'s value for ``steps`` (task index -> step)."""
    text = ",".join(f"{index}={step}" for index, step in sorted(steps.items()))
    return text if len(text) <= MAX_START_STEPS_CHARS else f"sum={sum(steps.values())}"


def decode_steps(value: str | None) -> dict[int, int] | None:
    """Inverse of :func:`encode_steps`; the sum form as ``{-1: sum}``; ``None`` when absent or malformed."""
    if value is None:
        return None
    if value.startswith("sum="):
        return {-1: int(value[4:])} if value[4:].isdigit() else None
    steps = {}
    for item in filter(None, value.split(",")):
        index, _, step = item.partition("=")
        if not (index.isdigit() and step.isdigit()):
            return None
        steps[int(index)] = int(step)
    return steps


def comparable_steps(start: dict[int, int] | None, end: dict[int, int] | None) -> tuple[dict | None, dict | None]:
    """Both step maps in the same form: per task, or both summed (``{-1: sum}``) when one is."""
    if start is None or end is None or (-1 not in start and -1 not in end):
        return start, end
    return {-1: sum(start.values())}, {-1: sum(end.values())}


# --- the summary (the execute operator's return value, so its ``return_value`` XCom) ----------
class ExecutionEntry(TypedDict):
    """One finished execution of the try, in the order they ran."""

    name: str
    """Full execution name."""
    state: str
    """:class:`~airflow_gpu_resilience.outcome.ExecutionState` value."""
    action: str
    """:class:`~airflow_gpu_resilience.outcome.Action` value the operator took."""
    reason: str
    """The decision's one-sentence reason."""
    log_uri: str
    """The execution's log URI (may be empty)."""
    duration_seconds: float | None
    """Start to completion, or ``None`` when a time is missing."""
    tasks: list[dict[str, Any]]
    """Every task's :meth:`~airflow_gpu_resilience.outcome.TaskOutcome.to_dict`; empty for an execution
    older than the newest :data:`~airflow_gpu_resilience.run_carry.MAX_EXECUTIONS_WITH_TASKS`."""
    task_outcomes: NotRequired[dict[str, int]]
    """Only where ``tasks`` was emptied: class -> its tasks in it."""


class AttemptEntry(TypedDict):
    """One finished task attempt: :meth:`~airflow_gpu_resilience.outcome.AttemptRecord.to_dict`
    plus the execution it belongs to and its class."""

    execution: str
    task_index: int
    attempt: int
    """0-based attempt number within its execution."""
    exit_code: int | None
    term_signal: int | None
    status_code: int
    message: str
    duration_seconds: float | None
    outcome: str
    """:class:`~airflow_gpu_resilience.outcome.OutcomeClass` value."""


class TaskSummary(TypedDict):
    """One task over every execution of the try."""

    index: int
    attempts: int
    """Attempts of this try's executions (Cloud Run's ``retried + 1`` each), also unlisted ones."""
    exit_codes: list[int]
    """The listed attempts' exit codes in order; a signal death shows as ``-signal``."""
    outcomes: list[str]
    """The listed attempts' classes in order."""
    unlisted: NotRequired[dict[str, int]]
    """Only when some of its attempts are not listed (beyond the newest
    :data:`~airflow_gpu_resilience.run_carry.MAX_ATTEMPTS_PER_TASK`): class -> those attempts."""


class LostWork(TypedDict):
    """An attempt that resumed behind the progress its predecessor had made (worker files)."""

    task_index: int
    execution: str
    """Short execution id, as the worker writes it."""
    attempt: int
    resumed_from_step: int
    lost_steps: int


class ChainEntry(TypedDict):
    """One execution of the task instance (all tries, oldest first), as Cloud Run and the bucket show it."""

    name: str
    """Full execution name."""
    index: int
    """Its 0-based position in the chain (0: the task instance's first execution)."""
    outcome: str | None
    """Its class (:class:`~airflow_gpu_resilience.outcome.OutcomeClass` value), ``None`` if unknown."""
    start_steps: dict[str, int] | None
    """Task index (as a string) -> newest committed step at its start; ``None``: not recorded."""
    end_steps: dict[str, int] | None
    """The same at its end (the next execution's start, or the bucket now for the newest)."""
    progress: bool | None
    """Whether a task's newest committed step grew; ``None`` when unknown."""


class RunSummary(TypedDict):
    """What the execute operator returns once every task succeeded.

    Attempts are listed as seen while polling: one that starts and ends between two polls is
    counted in :attr:`TaskSummary.attempts` but not listed; the last attempt of each execution
    always is. The lists are bounded (see :mod:`~airflow_gpu_resilience.run_carry`): per task the
    newest attempts, the rest counted in :attr:`TaskSummary.unlisted`; the newest executions with
    their tasks, older ones with their tasks' count per class. ``progress`` and ``lost_work``
    come from the worker's ``progress.json`` and ``metrics.json`` only when ``checkpoint_bucket``
    is set; otherwise they are empty.
    """

    job: str
    """Full job name."""
    job_name: str
    task_count: int
    outcome: str
    """Always ``"SUCCEEDED"`` (any other outcome raises)."""
    reruns: int
    """Re-run executions of the task instance, over all its tries."""
    executions: list[ExecutionEntry]
    tasks: list[TaskSummary]
    attempts: list[AttemptEntry]
    preemptions: list[AttemptEntry]
    """The attempts classed PREEMPTED or TIMED_OUT."""
    progress: dict[str, dict[str, Any]]
    """Task index (as a string) -> :meth:`~airflow_gpu_resilience.hooks.progress.TaskProgress.to_dict`."""
    lost_work: list[LostWork]
    lost_steps_total: int
    chain: list[ChainEntry]
    """Every execution of the task instance with its class and checkpoint steps (empty without
    ``checkpoint_bucket``)."""
    goodput: NotRequired[GoodputReport | None]
    """Where every second of the try's attempts went (:mod:`~airflow_gpu_resilience.goodput`);
    ``None`` when it could not be built."""


def chain_entries(history: Sequence[ExecutionProgress]) -> list[ChainEntry]:
    """The summary's ``chain`` from the progress history."""

    def keyed(steps: Mapping[int, int] | None) -> dict[str, int] | None:
        return None if steps is None else {str(k): v for k, v in sorted(steps.items())}

    return [
        ChainEntry(name=entry.name, index=index, outcome=entry.outcome.value if entry.outcome else None,
                   start_steps=keyed(entry.start_steps), end_steps=keyed(entry.end_steps),
                   progress=entry.made_progress)
        for index, entry in enumerate(history)
    ]


# --- the settings and the run state of one try ------------------------------------------
#: Default seconds a read of the committed checkpoint steps retries the bucket for (the execute
#: operator's ``progress_read_timeout``): a re-run decision waits out a bucket outage of a few
#: minutes and still decides on the steps; the run's tasks are not running meanwhile.
DEFAULT_PROGRESS_READ_TIMEOUT = 300.0


@dataclass(frozen=True)
class RunSettings:
    """The execute operator's arguments that its run manager acts on, rendered and checked.

    :param job_name: the job id.
    :param region: the Cloud Run region.
    :param max_preemption_reruns: the fixed re-run budget without a checkpoint bucket; with one,
        the executions of unknown progress passed over (default 3).
    :param max_reruns_without_progress: with a checkpoint bucket (default
        :data:`~airflow_gpu_resilience.rerun_budget.DEFAULT_MAX_RERUNS_WITHOUT_PROGRESS`).
    :param max_total_reruns: with a checkpoint bucket (default
        :data:`~airflow_gpu_resilience.rerun_budget.DEFAULT_MAX_TOTAL_RERUNS`).
    :param overrides: ``RunJobRequest.Overrides`` in dict form for every execution, or ``None``.
    :param fatal_exit_codes: exit codes classed FATAL (default 64-78).
    :param poll_interval: seconds between polls (> 0; default 10).
    :param wait_timeout: seconds to wait for one execution, or ``None`` (no limit).
    :param checkpoint_bucket: the checkpoint bucket, or ``None`` (progress cannot be read).
    :param checkpoint_prefix: the folder of the task folders in it (default: the job name).
    :param progress_read_timeout: seconds a read of the committed steps retries the bucket for
        (default :data:`DEFAULT_PROGRESS_READ_TIMEOUT`).
    :param log_container_output: copy the execution's Cloud Logging lines into the task log.
    :param gcp_conn_id: the Airflow connection of the Logging and Storage reads.
    :param impersonation_chain: service account (or chain) to impersonate, or ``None``.
    :param progress_log_interval: seconds between progress log lines while polling (default 60).
    """

    job_name: str
    region: str
    max_preemption_reruns: int = 3
    max_reruns_without_progress: int = DEFAULT_MAX_RERUNS_WITHOUT_PROGRESS
    max_total_reruns: int = DEFAULT_MAX_TOTAL_RERUNS
    overrides: Mapping[str, Any] | None = None
    fatal_exit_codes: Collection[int] = DEFAULT_FATAL_EXIT_CODES
    poll_interval: float = 10.0
    wait_timeout: float | None = None
    checkpoint_bucket: str | None = None
    checkpoint_prefix: str | None = None
    progress_read_timeout: float = DEFAULT_PROGRESS_READ_TIMEOUT
    log_container_output: bool = False
    gcp_conn_id: str = "google_cloud_default"
    impersonation_chain: str | Sequence[str] | None = None
    progress_log_interval: float = 60.0


@dataclass
class RunState:
    """What one try of the execute operator carries from execution to execution.

    It travels through the trigger as its ``carry`` (:meth:`to_dict` / :meth:`from_dict`,
    JSON-able), since nothing on the operator survives a deferral. Its lists are bounded by the
    task count, not by the executions (:mod:`~airflow_gpu_resilience.run_carry`); a carry of an
    earlier release, which listed everything, is read and bounded.

    :param project_id: the Google Cloud project of the job.
    :param run_key: :meth:`~airflow_gpu_resilience.operators.cloud_run.CloudRunGpuExecuteJobOperator.run_key`
        of the task instance.
    :param budget: ``max_preemption_reruns`` as rendered (an integer >= 0): the fixed budget
        without ``checkpoint_bucket``; with it, the executions of unknown progress passed over.
    :param max_reruns_without_progress: as rendered (an integer >= 0).
    :param max_total_reruns: as rendered (an integer >= 0).
    :param deadline: epoch seconds when the try's overall ``timeout`` passes, or ``None``.
    :param overall_limit: whether the current wait ends at ``deadline`` (a timeout then cancels
        the execution) rather than at ``wait_timeout``.
    :param executions: the finished executions so far.
    :param attempts: their finished task attempts.
    :param progress: the latest progress read per task.
    :param classes: execution name -> its class, once known (saves listing its tasks again).
    :param task_attempts: task index (as a string) -> its attempts over the executions so far.
    :param unlisted_attempts: task index (as a string) -> class -> its attempts no longer listed.
    """

    project_id: str
    run_key: str
    budget: int
    max_reruns_without_progress: int = DEFAULT_MAX_RERUNS_WITHOUT_PROGRESS
    max_total_reruns: int = DEFAULT_MAX_TOTAL_RERUNS
    deadline: float | None = None
    overall_limit: bool = False
    executions: list[ExecutionEntry] = field(default_factory=list)
    attempts: list[AttemptEntry] = field(default_factory=list)
    progress: dict[str, dict[str, Any]] = field(default_factory=dict)
    classes: dict[str, str] = field(default_factory=dict)
    task_attempts: dict[str, int] = field(default_factory=dict)
    unlisted_attempts: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form for the trigger's ``carry``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunState:
        """Inverse of :meth:`to_dict` (keys it does not know are ignored); an earlier release's carry
        is upgraded and bounded (:func:`~airflow_gpu_resilience.run_carry.upgrade`)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in upgrade(data).items() if key in known})

    def next_wait(self, wait_timeout: float | None, now: float) -> float | None:
        """Seconds the next wait may last, and set :attr:`overall_limit` to whether that is the deadline.

        :param wait_timeout: the operator's ``wait_timeout`` (seconds) or ``None``.
        :param now: ``time.time()``.
        :return: ``wait_timeout`` or the time left to ``deadline``, whichever is shorter; ``None``: no limit.
        """
        if self.deadline is None:
            self.overall_limit = False
            return wait_timeout
        left = max(0.0, self.deadline - now)
        self.overall_limit = wait_timeout is None or wait_timeout >= left
        return left if self.overall_limit else wait_timeout

    def add_execution(
        self,
        execution: run_v2.Execution,
        outcomes: Sequence[TaskOutcome],
        attempts: AttemptLog,
        decision: Decision,
        fatal_exit_codes: Collection[int],
    ) -> list[AttemptEntry]:
        """Record a finished execution and its attempts (those beyond the bounds counted, not listed).

        :param execution: the finished execution.
        :param outcomes: its classified tasks.
        :param attempts: its finished attempts.
        :param decision: what the operator does with it.
        :param fatal_exit_codes: exit codes classed FATAL.
        :return: the attempts' new entries, in order.
        """
        self.executions.append(
            ExecutionEntry(
                name=execution.name, state=execution_state(execution).value, action=decision.action.value,
                reason=decision.reason, log_uri=execution.log_uri, duration_seconds=elapsed_seconds(execution),
                tasks=[o.to_dict() for o in outcomes],
            )
        )
        entries = [
            AttemptEntry(
                task_index=r.task_index, attempt=r.attempt, exit_code=r.exit_code, term_signal=r.term_signal,
                status_code=r.status_code, message=r.message, duration_seconds=r.duration_seconds,
                execution=execution.name, outcome=r.classify(fatal_exit_codes).value,
            )
            for r in attempts.records
        ]
        add_task_attempts(self.task_attempts, self.executions[-1]["tasks"])
        self.attempts = bound_attempts([*self.attempts, *entries], self.unlisted_attempts)
        compact_executions(self.executions)
        return entries

    def summary(self, job: str, task_count: int, reruns: int, lost_work: list[LostWork],
                chain: list[ChainEntry] | None = None) -> RunSummary:
        """The :class:`RunSummary` once the last execution succeeded.

        :param job: full job name.
        :param task_count: tasks per execution.
        :param reruns: re-run executions of the task instance (all tries).
        :param lost_work: from the worker's files (may be empty).
        :param chain: every execution of the task instance with its checkpoint steps (default none).
        """
        tasks: dict[int, TaskSummary] = {}

        def task(index: int) -> TaskSummary:
            return tasks.setdefault(index, TaskSummary(index=index, attempts=0, exit_codes=[], outcomes=[]))

        for index, attempts in self.task_attempts.items():
            task(int(index))["attempts"] = attempts
        for index, counts in self.unlisted_attempts.items():
            task(int(index))["unlisted"] = dict(counts)
        for attempt in self.attempts:
            entry = task(attempt["task_index"])
            signal = attempt["term_signal"]
            entry["exit_codes"].append(attempt["exit_code"] if signal is None else -int(signal))
            entry["outcomes"].append(attempt["outcome"])
        resumable = {c.value for c in RESUMABLE}
        return RunSummary(
            job=job, job_name=job.rsplit("/", 1)[-1], task_count=task_count, outcome=OutcomeClass.SUCCEEDED.value,
            reruns=reruns, executions=self.executions, tasks=[tasks[i] for i in sorted(tasks)],
            attempts=self.attempts, preemptions=[a for a in self.attempts if a["outcome"] in resumable],
            progress=self.progress, lost_work=lost_work,
            lost_steps_total=sum(item["lost_steps"] for item in lost_work), chain=list(chain or []),
        )


@dataclass(frozen=True)
class RunStep:
    """Where the run stands after the operator acted on an execution.

    Exactly one field is set: :attr:`execution` (wait for it next) or :attr:`summary` (done).
    Build it with :meth:`wait` or :meth:`done`.
    """

    execution: str | None = None
    summary: RunSummary | None = None

    def __post_init__(self) -> None:
        if (self.execution is None) == (self.summary is None):
            raise ValueError("a RunStep has exactly one of execution and summary")

    @classmethod
    def wait(cls, execution: str) -> RunStep:
        """Wait for ``execution`` (full name) next."""
        return cls(execution=execution)

    @classmethod
    def done(cls, summary: RunSummary) -> RunStep:
        """The run is done with ``summary``."""
        return cls(summary=summary)

