"""Operators that deploy a Cloud Run GPU job and run it to completion through preemptions.

Thin by design: every API call goes through :class:`~airflow_gpu_resilience.hooks.cloud_run.CloudRunGpuHook`,
every validation rule lives in :mod:`~airflow_gpu_resilience.job_spec`, and every decision
about a finished execution in :mod:`~airflow_gpu_resilience.outcome`.

The module reads top-down: the typed summary the execute operator returns, the run state one
try carries from execution to execution (and through the trigger), then the two operators.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
import re
import time
import typing
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal, NoReturn, NotRequired, TypedDict

from google.api_core import exceptions as gexc
from google.cloud import run_v2

from airflow_gpu_resilience.compat import BaseOperator, default_deferrable

from airflow_gpu_resilience.exceptions import (
    CloudRunGpuExecutionError,
    CloudRunGpuFatalError,
    CloudRunGpuTimeoutError,
    CloudRunGpuWaitTimeout,
)
from airflow_gpu_resilience.hooks.cloud_run import (
    CloudRunGpuHook,
    execution_env,
    override_timeout_seconds,
    with_env_overrides,
)
from airflow_gpu_resilience.hooks.cloud_logging import CloudRunLogsHook, ExecutionLogFollower
from airflow_gpu_resilience.hooks.progress import CheckpointFilesHook
from airflow_gpu_resilience.job_spec import MAX_TASK_TIMEOUT_SECONDS, RESERVED_ENV, TASK_TIMEOUT_ENV, GpuJobSpec
from airflow_gpu_resilience.operators.goodput_report import GoodputReport, build_report
from airflow_gpu_resilience.links.cloud_run import CloudRunGpuExecutionLink, CloudRunGpuLogsLink
from airflow_gpu_resilience.outcome import (
    DEFAULT_FATAL_EXIT_CODES,
    DEFAULT_MAX_RERUNS_WITHOUT_PROGRESS,
    DEFAULT_MAX_TOTAL_RERUNS,
    RESUMABLE,
    Action,
    AttemptLog,
    Decision,
    ExecutionProgress,
    ExecutionState,
    OutcomeClass,
    ProgressBudget,
    TaskOutcome,
    classify_task,
    decide,
    elapsed_seconds,
    execution_state,
)
from airflow_gpu_resilience.triggers.cloud_run import (
    DEFER_TIMEOUT_MARGIN,
    CloudRunGpuExecutionTrigger,
    ExecutionEventStatus,
)

if TYPE_CHECKING:
    from airflow_gpu_resilience.compat import Context

__all__ = [
    "DEFER_TIMEOUT_MARGIN",
    "MAX_PROGRESS_TASKS",
    "RERUN_ENV",
    "RUN_KEY_ENV",
    "START_STEPS_ENV",
    "AttemptEntry",
    "ChainEntry",
    "CloudRunGpuDeployJobOperator",
    "CloudRunGpuExecuteJobOperator",
    "ExecutionEntry",
    "LostWork",
    "RunState",
    "RunStep",
    "RunSummary",
    "TaskSummary",
]

#: Container env var that marks an execution with the Airflow task instance that started it.
RUN_KEY_ENV = "AIRFLOW_GPU_RESILIENCE_RUN_KEY"
#: Container env var: ``0`` for a try's first execution, ``n`` for the n-th preemption re-run.
RERUN_ENV = "AIRFLOW_GPU_RESILIENCE_RERUN"
#: Most tasks whose progress files are read (per poll) and whose lost work is reported.
MAX_PROGRESS_TASKS = 16
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
    """Every task's :meth:`~airflow_gpu_resilience.outcome.TaskOutcome.to_dict`."""


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
    always is. ``progress`` and ``lost_work`` come from the worker's ``progress.json`` and
    ``metrics.json`` only when ``checkpoint_bucket`` is set; otherwise they are empty.
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


# --- the run state of one try --------------------------------------------------------------
@dataclass
class RunState:
    """What one try of the execute operator carries from execution to execution.

    It travels through the trigger as its ``carry`` (:meth:`to_dict` / :meth:`from_dict`,
    JSON-able), since nothing on the operator survives a deferral.

    :param project_id: the Google Cloud project of the job.
    :param run_key: :meth:`CloudRunGpuExecuteJobOperator.run_key` of the task instance.
    :param budget: ``max_preemption_reruns`` as rendered (an integer >= 0): the fixed budget
        that applies when the checkpoint steps cannot be read.
    :param max_reruns_without_progress: as rendered (an integer >= 0).
    :param max_total_reruns: as rendered (an integer >= 0).
    :param deadline: epoch seconds when the try's overall ``timeout`` passes, or ``None``.
    :param overall_limit: whether the current wait ends at ``deadline`` (a timeout then cancels
        the execution) rather than at ``wait_timeout``.
    :param executions: the finished executions so far.
    :param attempts: their finished task attempts.
    :param progress: the latest progress read per task.
    :param classes: execution name -> its class, once known (saves listing its tasks again).
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

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form for the trigger's ``carry``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunState:
        """Inverse of :meth:`to_dict` (keys it does not know are ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})

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
        """Record a finished execution and its attempts.

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
        self.attempts.extend(entries)
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

        for execution in self.executions:
            for outcome in execution["tasks"]:
                task(outcome["index"])["attempts"] += outcome["attempts"]
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


# --- the deploy operator ----------------------------------------------------------------------
#: The :class:`GpuJobSpec` fields the deploy operator takes as keyword arguments: every field but
#: ``name`` (the operator's ``job_name``), with the spec's own defaults.
_SPEC_FIELDS: tuple[dataclasses.Field, ...] = tuple(f for f in dataclasses.fields(GpuJobSpec) if f.name != "name")
_SPEC_TYPES = typing.get_type_hints(GpuJobSpec)


def _spec_default(spec_field: dataclasses.Field) -> Any:
    """The field's default (a fresh one for a factory), or ``inspect.Parameter.empty`` when required."""
    if spec_field.default_factory is not dataclasses.MISSING:
        return spec_field.default_factory()
    if spec_field.default is not dataclasses.MISSING:
        return spec_field.default
    return inspect.Parameter.empty


def _is_templated(value: Any) -> bool:
    if isinstance(value, str):
        return "{{" in value or "{%" in value
    if isinstance(value, Mapping):
        return any(_is_templated(k) or _is_templated(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_is_templated(v) for v in value)
    return False


def _coerce(name: str, value: Any) -> Any:
    """A rendered template string in the spec field's type (``"3"`` -> 3, ``"False"`` -> False, ``""`` -> None)."""
    kind = _SPEC_TYPES[name]
    if kind is int and isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip()):
        return int(value)  # ASCII digits only (str.isdigit takes "²" and other scripts' digits)
    if kind is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if kind == (str | None) and value == "":
        return None
    return value


def _with_spec_parameters(init: Any) -> inspect.Signature:
    """``init``'s signature with every spec field as a keyword-only parameter before ``**kwargs``.

    Airflow reads an operator's signature to apply ``default_args`` and to check the arguments of
    ``partial()``/``expand()``, so the spec fields must appear in it.
    """
    signature = inspect.signature(init)
    *explicit, variadic = signature.parameters.values()
    spec = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_spec_default(f), annotation=f.type)
        for f in _SPEC_FIELDS
    ]
    return signature.replace(parameters=[*explicit, *spec, variadic])


class CloudRunGpuDeployJobOperator(BaseOperator):
    """Create or update a Cloud Run GPU job from a :class:`~airflow_gpu_resilience.job_spec.GpuJobSpec`.

    Idempotent: a job that already has the desired template is left unchanged. The spec is
    validated when the DAG is parsed if no argument is templated, else at execute, before any
    API call. Returns ``{"job", "job_name", "generation", "action"}`` and pushes the XComs
    ``job_name`` and ``generation``. The job carries the label ``managed-by=airflow-gpu-resilience``
    (added to ``labels``); an existing job of the same name without it is someone else's and is
    not changed (:class:`~airflow_gpu_resilience.exceptions.CloudRunJobNotOursError`) unless
    ``adopt_existing_job``.

    :param job_name: job id (templated).
    :param region: Cloud Run region (default ``us-central1``; templated).
    :param project_id: Google Cloud project; default from the connection (templated).
    :param gcp_conn_id: Airflow connection id (default ``google_cloud_default``; templated).
    :param impersonation_chain: service account (or chain) to impersonate (templated).
    :param transport: ``"rest"``, ``"grpc"`` or ``None`` (chosen from the endpoint).
    :param adopt_existing_job: take over an existing job of ``job_name`` that lacks the label:
        update it and label it (default ``False``: fail without changing it).
    :param kwargs: every other :class:`GpuJobSpec` field by name, with its default and meaning
        there (``image`` is required; ``command``, ``args``, ``env``, ``cpu``, ``memory``,
        ``gpu_type``, ``task_timeout`` in seconds, ``max_retries``, ``task_count``,
        ``checkpoint_bucket``, ...), all templated; then the ``BaseOperator`` arguments.
    :raises ValueError: at construction (or execute, when templated) for an invalid spec.
    :raises CloudRunJobNotOursError: at execute, the job exists without the label and
        ``adopt_existing_job`` is false (not retried).
    """

    template_fields: Sequence[str] = ("job_name", "region", "project_id", "gcp_conn_id", "impersonation_chain",
                                      *(f.name for f in _SPEC_FIELDS))

    def __init__(
        self,
        *,
        job_name: str,
        region: str = "us-central1",
        project_id: str | None = None,
        gcp_conn_id: str = "google_cloud_default",
        impersonation_chain: str | Sequence[str] | None = None,
        transport: Literal["rest", "grpc"] | None = None,
        adopt_existing_job: bool = False,
        **kwargs: Any,
    ) -> None:
        spec_values = {f.name: kwargs.pop(f.name, _spec_default(f)) for f in _SPEC_FIELDS}
        super().__init__(**kwargs)
        if not isinstance(adopt_existing_job, bool):
            raise ValueError(f"adopt_existing_job={adopt_existing_job!r} must be True or False")
        self.job_name, self.region, self.project_id = job_name, region, project_id
        self.gcp_conn_id, self.impersonation_chain, self.transport = gcp_conn_id, impersonation_chain, transport
        self.adopt_existing_job = adopt_existing_job
        for spec_field in _SPEC_FIELDS:
            value = spec_values[spec_field.name]
            if value is inspect.Parameter.empty:
                raise TypeError(f"{type(self).__name__} needs the keyword argument {spec_field.name!r}")
            if value is None and spec_field.default_factory is not dataclasses.MISSING:  # env=None, labels=None
                value = spec_field.default_factory()
            setattr(self, spec_field.name, list(value) if isinstance(value, tuple) else value)
        if not any(_is_templated(getattr(self, f)) for f in ("job_name", *spec_values)):
            self.build_spec()

    __init__.__signature__ = _with_spec_parameters(__init__)  # type: ignore[attr-defined]

    def build_spec(self) -> GpuJobSpec:
        """The validated spec from the (rendered) arguments.

        :raises ValueError: for an invalid value, naming the parameter.
        """
        values = {f.name: _coerce(f.name, getattr(self, f.name)) for f in _SPEC_FIELDS}
        return GpuJobSpec(name=self.job_name, **values)

    @cached_property
    def hook(self) -> CloudRunGpuHook:
        """The Cloud Run hook for this task's connection (built once)."""
        return CloudRunGpuHook(
            gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain, transport=self.transport
        )

    def execute(self, context: Context) -> dict[str, Any]:
        """Validate, then create or update the job; see the class docstring for the result."""
        spec = self.build_spec()
        project_id = self.project_id or self.hook.project_id
        job, action = self.hook.create_or_update_job(
            job_name=spec.name, job=spec, region=self.region, project_id=project_id,
            adopt_existing_job=self.adopt_existing_job,
        )
        self.log.info("Job %s %s (generation %s)", job.name, action, job.generation)
        context["ti"].xcom_push(key="job_name", value=spec.name)
        context["ti"].xcom_push(key="generation", value=int(job.generation))
        return {"job": job.name, "job_name": spec.name, "generation": int(job.generation), "action": action}


# --- the execute operator ---------------------------------------------------------------------
class CloudRunGpuExecuteJobOperator(BaseOperator):
    """Run a Cloud Run GPU job until every task succeeds, re-running preempted executions.

    After each execution the operator classifies every task's last attempt
    (:func:`~airflow_gpu_resilience.outcome.classify_task`) and decides
    (:func:`~airflow_gpu_resilience.outcome.decide`):

    - all tasks SUCCEEDED: return the :class:`RunSummary` (the ``return_value`` XCom);
    - only PREEMPTED / TIMED_OUT failures and re-runs left: start a new execution with the same
      overrides (the worker resumes from its checkpoints) and keep waiting (see the re-run
      budget below);
    - a FAILED task: raise :class:`~airflow_gpu_resilience.exceptions.CloudRunGpuExecutionError`
      (an ``AirflowException``; Airflow's ``retries`` apply) naming exit code and log URI;
    - a FATAL task, a cancelled execution, or the re-run budget exhausted: raise
      :class:`~airflow_gpu_resilience.exceptions.CloudRunGpuFatalError` (an
      ``AirflowFailException``: no Airflow retry).

    Either way the try's goodput account (every second of its attempts, and the GPU-seconds
    billed; see :mod:`~airflow_gpu_resilience.goodput`) is logged as a table when the task ends:
    on success it is the summary's ``goodput``; on a failure (and an overall ``timeout``) it is
    also built before raising, its one-line headline ends the error's message, the error
    carries it as ``goodput`` and it is pushed as the ``goodput`` XCom. Building it never
    raises: a failed read leaves it ``None`` and the original error stands.

    **The re-run budget follows checkpoint progress** when ``checkpoint_bucket`` is set. A task
    made progress in an execution when its newest committed checkpoint step (the worker's commit
    records in the bucket) at the execution's end is greater than at its start. A re-run after an
    execution in which any task made progress is free; ``max_reruns_without_progress``
    consecutive re-runs without a new committed checkpoint end the task with
    :class:`~airflow_gpu_resilience.exceptions.CloudRunGpuFatalError` naming the step it is stuck
    at, the classes of those executions and what to check; ``max_total_reruns`` caps the re-runs
    in total, for cost. The steps at each execution's start are kept on the execution itself (env
    var ``AIRFLOW_GPU_RESILIENCE_START_STEPS``), so every try reads the same history from Cloud
    Run and the bucket. Without ``checkpoint_bucket`` (or while the bucket cannot be read) the
    fixed budget ``max_preemption_reruns`` applies instead, and the log says so. A task timeout
    is re-run like a preemption; a per-execution ``timeout`` override also reaches the container
    as ``TASK_TIMEOUT_SECONDS`` (the deploy operator sets it to the job's task timeout).

    It waits in the worker (:meth:`execute_sync`) or in the triggerer (:meth:`execute_async`,
    re-entered through :meth:`execute_complete`); both keep a :class:`RunState`.

    **State lives in Cloud Run, not in the operator.** Every execution carries container env
    vars: ``AIRFLOW_GPU_RESILIENCE_RUN_KEY`` (a hash of dag id, run id, task id and map index,
    the same for every try), ``AIRFLOW_GPU_RESILIENCE_RERUN`` (``0`` for the first execution
    of a try, ``n`` for the n-th preemption re-run) and ``AIRFLOW_GPU_RESILIENCE_START_ID``
    (one per RunJob request, so that a RunJob whose answer was lost is not sent twice). A new
    try (Airflow retry, worker restart) first attaches to a still-running execution with its run
    key instead of starting another; an execution that finished while no try was waiting (after
    ``wait_timeout``) is adopted if it succeeded or was only preempted. The preemption budget
    counts the re-run executions with that key: it is shared by all tries of the task instance.
    This holds after a clear of the task too: a cleared task whose newest execution succeeded
    returns that execution's summary without running the job again (trigger a new DAG run to
    run it again), and a cleared task shares the budget (raise ``max_preemption_reruns`` to give
    it more).

    :param job_name: job id (templated).
    :param region: Cloud Run region (default ``us-central1``; templated).
    :param project_id: Google Cloud project; default from the connection (templated).
    :param gcp_conn_id: Airflow connection id (default ``google_cloud_default``; templated).
    :param impersonation_chain: service account (or chain) to impersonate (templated).
    :param transport: ``"rest"``, ``"grpc"`` or ``None`` (chosen from the endpoint).
    :param overrides: ``RunJobRequest.Overrides`` in dict form (``container_overrides`` with
        ``args``/``env``, ``task_count``, ``timeout``), applied to every execution, re-runs
        included (templated; default ``None``).
    :param max_preemption_reruns: the fixed budget: new executions allowed after preemptions or
        task timeouts, in total over all tries of the task instance, when progress cannot be read
        (no ``checkpoint_bucket``, or the bucket is unreadable); separate from Airflow's
        ``retries`` (default 3; an integer >= 0; templated). With a readable bucket the
        progress rule replaces it.
    :param max_reruns_without_progress: consecutive re-runs that commit no new checkpoint before
        the task fails without retry (default 2; an integer >= 0; templated). Used with
        ``checkpoint_bucket``.
    :param max_total_reruns: re-runs allowed in total with ``checkpoint_bucket``, with or without
        progress: a cost cap (default 48, enough for a day on the one-hour GA GPU task timeout
        with a preemption every hour; an integer >= 0; templated).
    :param fatal_exit_codes: exit codes that fail without retry (default 64-78, BSD sysexits).
    :param deferrable: wait in the triggerer; ``False`` polls in the worker (default ``True``, or
        ``[operators] default_deferrable`` where the deployment sets it).
    :param poll_interval: seconds between polls (default 10; templated).
    :param wait_for_completion: wait for the execution and act on its outcome (default ``True``);
        ``False`` starts the execution (or attaches to this task instance's running one), pushes
        ``execution_name`` and returns ``{"execution", "job_name"}`` at once, for an execution
        sensor downstream. Then nothing is re-run after preemptions.
    :param wait_timeout: seconds to wait for one execution before failing this try without
        cancelling it (retryable; the next try attaches to it); default ``None``: no limit.
    :param timeout: total seconds for this try, across re-runs and deferrals, in both modes
        (a ``timedelta`` is accepted); when it passes the running execution is cancelled and
        :class:`~airflow_gpu_resilience.exceptions.CloudRunGpuTimeoutError` is raised (Airflow's
        ``retries`` apply). Default ``None``: Airflow's ``execution_timeout`` if set (which
        Airflow itself does not apply across deferrals), else no limit.
    :param checkpoint_bucket: the job's checkpoint bucket; when set, the worker's
        ``progress.json`` is logged while waiting (with ETA) and the work lost to each
        preemption is added to the summary. Unreadable files never fail the task (templated;
        default ``None``).
    :param checkpoint_prefix: folder of the task folders in the bucket (default: the job name;
        templated).
    :param log_container_output: copy the execution's container and platform log lines (the
        worker's "SIGTERM received ...", "resuming from step ...", the maintenance message) from
        Cloud Logging into the task log, each line once (default ``False``: no Logging call is
        made; templated: a bool, or ``"true"``/``"false"``). Needs ``roles/logging.viewer``; reads stay within Cloud Logging's read quota
        (:class:`~airflow_gpu_resilience.hooks.cloud_logging.ExecutionLogFollower`: at most 12
        ``entries:list`` requests a minute). Polling in the worker, lines appear while waiting
        and the rest when the execution ends; deferred, the trigger does not read logs: the
        operator copies each execution's lines when it resumes after that execution.
    :raises ValueError: at construction for a negative or non-integer ``max_preemption_reruns``,
        ``max_reruns_without_progress`` or ``max_total_reruns``, a bad ``timeout`` or ``log_container_output``.
    """

    template_fields: Sequence[str] = (
        "job_name", "region", "project_id", "gcp_conn_id", "impersonation_chain", "overrides",
        "max_preemption_reruns", "max_reruns_without_progress", "max_total_reruns",
        "checkpoint_bucket", "checkpoint_prefix", "poll_interval",
        "log_container_output",
    )
    template_fields_renderers = {"overrides": "json"}
    operator_extra_links = (CloudRunGpuExecutionLink(), CloudRunGpuLogsLink())
    #: Seconds between progress log lines while polling in the worker (sync mode).
    progress_log_interval: float = 60.0

    def __init__(
        self,
        *,
        job_name: str,
        region: str = "us-central1",
        project_id: str | None = None,
        gcp_conn_id: str = "google_cloud_default",
        impersonation_chain: str | Sequence[str] | None = None,
        transport: Literal["rest", "grpc"] | None = None,
        overrides: dict[str, Any] | None = None,
        max_preemption_reruns: int | str = 3,
        fatal_exit_codes: Collection[int] | None = None,
        deferrable: bool = default_deferrable(fallback=True),
        poll_interval: float | str = 10.0,
        wait_for_completion: bool = True,
        wait_timeout: float | None = None,
        timeout: float | timedelta | None = None,
        checkpoint_bucket: str | None = None,
        checkpoint_prefix: str | None = None,
        max_reruns_without_progress: int | str = DEFAULT_MAX_RERUNS_WITHOUT_PROGRESS,
        max_total_reruns: int | str = DEFAULT_MAX_TOTAL_RERUNS,
        log_container_output: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.job_name, self.region, self.project_id = job_name, region, project_id
        self.gcp_conn_id, self.impersonation_chain, self.transport = gcp_conn_id, impersonation_chain, transport
        self.overrides = overrides
        self.max_preemption_reruns = max_preemption_reruns
        self.max_reruns_without_progress, self.max_total_reruns = max_reruns_without_progress, max_total_reruns
        self.fatal_exit_codes = sorted(fatal_exit_codes if fatal_exit_codes is not None else DEFAULT_FATAL_EXIT_CODES)
        self.deferrable, self.poll_interval, self.wait_timeout = deferrable, poll_interval, wait_timeout
        self.wait_for_completion = wait_for_completion
        self.timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        self.checkpoint_bucket, self.checkpoint_prefix = checkpoint_bucket, checkpoint_prefix
        self._running_execution: str | None = None
        self._last_progress_log = float("-inf")
        for name in ("max_preemption_reruns", "max_reruns_without_progress", "max_total_reruns"):
            if not isinstance(getattr(self, name), str):  # a template is checked once rendered
                _count(name, getattr(self, name))
        self.log_container_output: bool | str = log_container_output
        if not isinstance(log_container_output, str):
            _flag("log_container_output", log_container_output)  # a template is checked at execute
        self._log_follower: ExecutionLogFollower | None = None
        # checked when the DAG is parsed; poll_interval only when it is not a template, the
        # rendered value is checked at execute, also before any API call
        if self.timeout is not None:
            self.timeout = _seconds("timeout", self.timeout)
        if wait_timeout is not None:
            self.wait_timeout = _seconds("wait_timeout", wait_timeout)
        if not isinstance(poll_interval, str):
            self.poll_interval = _seconds("poll_interval", poll_interval)

    @cached_property
    def hook(self) -> CloudRunGpuHook:
        """The Cloud Run hook for this task's connection (built once per operator instance)."""
        return CloudRunGpuHook(
            gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain, transport=self.transport
        )

    # --- the two paths ---------------------------------------------------------------------
    def execute(self, context: Context) -> RunSummary | dict[str, str]:
        """Attach to this task instance's running execution or start one, then wait.

        :return: the :class:`RunSummary`; with ``wait_for_completion=False``
            ``{"execution", "job_name"}`` of the execution started or attached to.
        :raises ValueError: ``max_preemption_reruns`` rendered to a negative or non-integer value,
            ``poll_interval`` to a non-positive one, or ``overrides`` that Cloud Run would refuse
            (:func:`check_overrides`), before any API call.
        :raises CloudRunGpuExecutionError: a task FAILED, or polling hit a non-transient error.
        :raises CloudRunGpuWaitTimeout: ``wait_timeout`` passed (retryable; the next try attaches).
        :raises CloudRunGpuTimeoutError: ``timeout`` passed; the execution was cancelled.
        :raises CloudRunGpuFatalError: FATAL, cancelled, or the preemption budget is exhausted.
        """
        budget = self._budget()
        without_progress = _count("max_reruns_without_progress", self.max_reruns_without_progress)
        total = _count("max_total_reruns", self.max_total_reruns)
        self.poll_interval = _seconds("poll_interval", self.poll_interval)
        self.log_container_output = _flag("log_container_output", self.log_container_output)
        check_overrides(self.overrides)
        run = RunState(project_id=self.project_id or self.hook.project_id, run_key=self.run_key(context),
                       budget=budget, deadline=self._deadline(), max_reruns_without_progress=without_progress,
                       max_total_reruns=total)
        if self.checkpoint_bucket:
            self.log.info("Re-runs follow checkpoint progress in gs://%s: max_reruns_without_progress=%s, "
                          "max_total_reruns=%s", self.checkpoint_bucket, without_progress, total)
        else:
            self.log.info("No checkpoint_bucket: checkpoint progress cannot be read, so the fixed budget "
                          "max_preemption_reruns=%s applies to re-runs", budget)
        step = self._attach_or_start(context, run)
        if step.execution is not None and not self.wait_for_completion:
            self.log.info("Not waiting for %s (wait_for_completion=False)", step.execution)
            return {"execution": step.execution, "job_name": self.job_name}
        if self.deferrable:
            return self.execute_async(context, run, step)
        return self.execute_sync(context, run, step)

    def execute_sync(self, context: Context, run: RunState, step: RunStep) -> RunSummary:
        """Poll in the worker until the run is done, re-running after preemptions.

        :param run: this try's state.
        :param step: the execution to wait for first (or the summary, returned at once).
        :return: the summary; raises as :meth:`execute` does.
        """
        while step.execution is not None:
            attempts = self._poll_until_done(run, step.execution)
            step = self._after_finish(context, run, step.execution, attempts)
        assert step.summary is not None
        return step.summary

    def execute_async(self, context: Context, run: RunState, step: RunStep) -> RunSummary:
        """Defer to :class:`CloudRunGpuExecutionTrigger` for ``step``'s execution; :meth:`execute_complete` resumes.

        :param run: this try's state; it travels as the trigger's ``carry``.
        :param step: the execution to wait for (or the summary, returned at once).
        :return: the summary when ``step`` has one; else it defers (raises ``TaskDeferred``).
        """
        if step.summary is not None:
            return step.summary
        limit = run.next_wait(self.wait_timeout, time.time())  # before the state is serialized
        trigger = CloudRunGpuExecutionTrigger(
            execution=step.execution, gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain,
            transport=self.transport, poll_interval=_seconds("poll_interval", self.poll_interval),
            timeout=limit, carry=run.to_dict(),
        )
        self.defer(trigger=trigger, method_name="execute_complete", timeout=trigger.defer_timeout)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> RunSummary:
        """Resume after the trigger: decide on the finished execution with a fresh hook.

        :param event: the trigger's event (see :class:`CloudRunGpuExecutionTrigger`); its
            ``carry`` is the :meth:`RunState.to_dict` deferred with.
        :return: the summary, or defers again after starting a re-run.
        :raises CloudRunGpuWaitTimeout: ``wait_timeout`` passed (retryable; the next try attaches
            to the still-running execution).
        :raises CloudRunGpuTimeoutError: ``timeout`` passed; the execution was cancelled.
        :raises CloudRunGpuExecutionError: a task FAILED, or the trigger hit an API error.
        :raises CloudRunGpuFatalError: FATAL, cancelled, or the preemption budget is exhausted.
        """
        execution, status = event["execution"], event["status"]
        run = RunState.from_dict(event["carry"])
        self._running_execution = execution
        files = self._files()
        if files is not None:
            self._log_progress(files, run, int(self.hook.get_execution(execution=execution).task_count))
        if status == ExecutionEventStatus.TIMEOUT.value:
            self._timed_out(run, execution, event["message"])
        if status == ExecutionEventStatus.ERROR.value:
            raise CloudRunGpuExecutionError(f"Polling {execution} failed: {event['message']}", execution=execution)
        step = self._after_finish(context, run, execution, AttemptLog.from_dicts(event.get("attempts") or []))
        return self.execute_async(context, run, step)

    def on_kill(self) -> None:
        """Cancel the execution this operator is waiting for (the trigger does so when deferred)."""
        if self._running_execution:
            self.log.info("Cancelling execution %s", self._running_execution)
            self.hook.cancel_execution(execution=self._running_execution)

    # --- starting or attaching -------------------------------------------------------------
    @staticmethod
    def run_key(context: Context) -> str:
        """Stable id of this task instance (all tries): hash of dag id, run id, task id, map index."""
        ti = context["ti"]
        raw = f"{ti.dag_id}|{ti.run_id}|{ti.task_id}|{getattr(ti, 'map_index', -1)}"
        return hashlib.sha256(raw.encode()).hexdigest()[:32]

    def _budget(self) -> int:
        return _count("max_preemption_reruns", self.max_preemption_reruns)

    def _deadline(self) -> float | None:
        """Epoch seconds when this try must end (``timeout``, else ``execution_timeout``)."""
        limit = self.timeout
        if limit is None and self.execution_timeout is not None:
            limit = self.execution_timeout.total_seconds()
        return None if limit is None else time.time() + limit

    def _attach_or_start(self, context: Context, run: RunState) -> RunStep:
        """Carry on with an earlier try's newest execution, or start one.

        A still-running execution is attached to. A finished one that no try has acted on yet
        (it ended after a try gave up waiting) is adopted when it succeeded or only lost tasks to
        preemptions or task timeouts: the run is done, it is re-run, or the budget is reported
        exhausted. A FAILED, FATAL or CANCELLED one was already acted on (the earlier try
        raised): a new execution starts.
        """
        found = self.hook.find_executions(job_name=self.job_name, region=self.region,
                                          env={RUN_KEY_ENV: run.run_key}, project_id=run.project_id)
        newest = found[0] if found else None
        if newest is not None and execution_state(newest) is ExecutionState.RUNNING:
            self.log.info("Attaching to execution %s started by an earlier try", newest.name)
            self._remember(context, newest.name)
            return RunStep.wait(newest.name)
        if newest is not None and self._adoptable(run, newest):
            self.log.info("Adopting execution %s: it finished while no try was waiting", newest.name)
            self._remember(context, newest.name)
            return self._after_finish(context, run, newest.name, AttemptLog())
        return RunStep.wait(self._start(context, run, rerun=0))

    def _adoptable(self, run: RunState, execution: run_v2.Execution) -> bool:
        tasks = self.hook.list_tasks(execution=execution.name)
        decision = decide([classify_task(t, self.fatal_exit_codes) for t in tasks], state=execution_state(execution),
                          reruns_used=self._reruns_used(run), max_reruns=run.budget)
        # A FAILED, FATAL or CANCELLED outcome was raised by an earlier try; the others never are
        # before the decision is acted on (a re-run, a summary, or "budget exhausted").
        return decision.outcome in (OutcomeClass.SUCCEEDED, *RESUMABLE)

    def _reruns_used(self, run: RunState) -> int:
        """Re-run executions of this task instance so far, counted in Cloud Run (all tries)."""
        executions = self.hook.find_executions(job_name=self.job_name, region=self.region,
                                               env={RUN_KEY_ENV: run.run_key}, project_id=run.project_id)
        return sum(1 for e in executions if execution_env(e).get(RERUN_ENV, "0") != "0")

    def _start(self, context: Context, run: RunState, rerun: int) -> str:
        env = {RUN_KEY_ENV: run.run_key, RERUN_ENV: str(rerun)}  # start_execution adds TASK_TIMEOUT_SECONDS
        files = self._files()
        steps = files.committed_steps() if files is not None else None
        if steps is not None:  # the progress record lives on the execution, for every later try
            env[START_STEPS_ENV] = encode_steps(steps)
        name = self.hook.start_execution(
            job_name=self.job_name, region=self.region, project_id=run.project_id,
            overrides=with_env_overrides(self.overrides, env),
        )
        self.log.info("Started execution %s%s", name, f" (preemption re-run {rerun})" if rerun else "")
        self._remember(context, name)
        return name

    def _remember(self, context: Context, name: str) -> None:
        self._running_execution = name
        context["ti"].xcom_push(key="execution_name", value=name)
        log_uri = self.hook.get_execution(execution=name).log_uri
        CloudRunGpuExecutionLink.persist(context, execution=name)
        CloudRunGpuLogsLink.persist(context, execution=name, log_uri=log_uri)

    # --- waiting in the worker -------------------------------------------------------------
    def _poll_until_done(self, run: RunState, execution: str) -> AttemptLog:
        """Block until ``execution`` finishes; the finished attempts seen while polling."""
        limit = run.next_wait(self.wait_timeout, time.time())
        attempts = AttemptLog()
        files = self._files()

        def log_progress(current: run_v2.Execution, tasks: list[run_v2.Task]) -> None:
            self._copy_container_logs(execution)
            if files is not None and time.monotonic() - self._last_progress_log >= self.progress_log_interval:
                self._last_progress_log = time.monotonic()
                self._log_progress(files, run, current.task_count)

        try:
            self.hook.wait_for_execution(execution, poll_interval=self.poll_interval, timeout=limit,
                                         on_poll=log_progress, attempts=attempts)
        except TimeoutError:
            self._timed_out(run, execution, f"still running after {limit:g} s")
        return attempts

    def _timed_out(self, run: RunState, execution: str, message: str) -> NoReturn:
        """Raise for a wait that hit its limit; cancel the execution if it was the overall ``timeout``."""
        self._running_execution = None
        if not run.overall_limit:
            raise CloudRunGpuWaitTimeout(f"Execution {execution} {message}", execution=execution)
        self.log.warning("Overall timeout passed: cancelling execution %s", execution)
        try:
            self.hook.cancel_execution(execution=execution)
        except gexc.NotFound as exc:  # deleted meanwhile; a finished one is returned unchanged
            self.log.info("Cancel of %s not needed: %s", execution, exc)
        report = self._goodput(run, failed=True, also=execution)
        raise CloudRunGpuTimeoutError(
            f"The task's overall timeout passed: execution {execution} {message} and was cancelled "
            f"({len(run.executions)} earlier execution(s) in this try)."
            + (f" {report['headline']}" if report else ""),
            execution=execution, goodput=report,
        )

    # --- acting on a finished execution ----------------------------------------------------
    def _after_finish(self, context: Context, run: RunState, execution: str, attempts: AttemptLog) -> RunStep:
        """Record the finished execution and act on the decision: done, a re-run to wait for, or raise."""
        self._copy_container_logs(execution, finished=True)
        finished = self.hook.get_execution(execution=execution)
        tasks = self.hook.list_tasks(execution=execution)
        attempts.observe(tasks)
        outcomes = [classify_task(t, self.fatal_exit_codes) for t in tasks]
        reruns_used = self._reruns_used(run)
        run.classes[execution] = _execution_class(outcomes, execution_state(finished)).value
        history = self._history(run)
        progress = None if history is None else ProgressBudget(
            history, run.max_reruns_without_progress, run.max_total_reruns)
        decision = decide(outcomes, state=execution_state(finished), reruns_used=reruns_used, max_reruns=run.budget,
                          progress=progress)
        for entry in run.add_execution(finished, outcomes, attempts, decision, self.fatal_exit_codes):
            self._log_attempt(entry)
        self.log.info("Execution %s: %s -> %s", execution, decision.reason, decision.action.value)
        if decision.action is Action.RERUN:
            return RunStep.wait(self._start(context, run, rerun=reruns_used + 1))
        self._running_execution = None
        if decision.action is Action.SUCCEED:
            job = execution.split("/executions/")[0]
            summary = run.summary(job, len(tasks), reruns_used, self._lost_work(run, len(tasks)),
                                  _chain(history or []))
            summary["goodput"] = self._goodput(run)
            return RunStep.done(summary)
        error = CloudRunGpuExecutionError if decision.action is Action.FAIL else CloudRunGpuFatalError
        report = self._goodput(run, failed=True, context=context)  # what the failed try cost, before raising
        raise error.for_decision(f"Execution {execution} {decision.outcome.value}", decision, finished, report)

    def _log_attempt(self, entry: AttemptEntry) -> None:
        if entry["outcome"] == OutcomeClass.UNOBSERVED.value:
            self.log.warning(
                "Attempt: %s task %s attempt %s: UNOBSERVED: it ended and Cloud Run retried it before a poll saw "
                "its result (the API keeps only the last attempt's); a shorter poll_interval (now %s s) sees more",
                entry["execution"], entry["task_index"], entry["attempt"], self.poll_interval)
            return
        signal, took = entry["term_signal"], entry["duration_seconds"]
        how = f"signal {signal}" if signal else f"exit code {entry['exit_code']}"
        log = self.log.warning if OutcomeClass(entry["outcome"]) in RESUMABLE else self.log.info
        log("Attempt: %s task %s attempt %s: %s (%s%s) %s", entry["execution"], entry["task_index"], entry["attempt"],
            entry["outcome"], how, "" if took is None else f", {took:g} s", entry["message"])

    # --- checkpoint progress ---------------------------------------------------------------
    def _history(self, run: RunState) -> list[ExecutionProgress] | None:
        """Every execution of the task instance, oldest first, with its checkpoint steps.

        Read from Cloud Run (the executions with this run key, each with the steps recorded at
        its start in :data:`START_STEPS_ENV`) and the bucket (the steps now, the end of the
        newest), never from this try's memory.

        :return: the history, or ``None`` without ``checkpoint_bucket`` or when the bucket cannot
            be read (the fixed budget then applies, and the log says so).
        """
        files = self._files()
        now = files.committed_steps() if files is not None else None
        if now is None:
            if files is not None:
                self.log.warning("Checkpoint progress unreadable in gs://%s: the fixed budget "
                                 "max_preemption_reruns=%s applies to this decision", self.checkpoint_bucket, run.budget)
            return None
        found = list(reversed(self.hook.find_executions(job_name=self.job_name, region=self.region,
                                                        env={RUN_KEY_ENV: run.run_key}, project_id=run.project_id)))
        starts = [decode_steps(execution_env(e).get(START_STEPS_ENV)) for e in found]
        history = []
        for i, execution in enumerate(found):
            start, end = _comparable(starts[i], starts[i + 1] if i + 1 < len(found) else now)
            history.append(ExecutionProgress(execution.name, self._class_of(run, execution), start, end))
        return history

    def _class_of(self, run: RunState, execution: run_v2.Execution) -> OutcomeClass | None:
        """The class of a finished execution (cached in ``run.classes``), ``None`` while it runs."""
        if execution.name not in run.classes:
            state = execution_state(execution)
            if state is ExecutionState.RUNNING:
                return None
            tasks = self.hook.list_tasks(execution=execution.name)
            run.classes[execution.name] = _execution_class(
                [classify_task(t, self.fatal_exit_codes) for t in tasks], state).value
        return OutcomeClass(run.classes[execution.name])

    # --- the worker's files ----------------------------------------------------------------
    def _files(self) -> CheckpointFilesHook | None:
        if not self.checkpoint_bucket:
            return None
        return CheckpointFilesHook(
            self.checkpoint_bucket, self.checkpoint_prefix or self.job_name,
            gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain,
        )

    def _log_progress(self, files: CheckpointFilesHook, run: RunState, task_count: int) -> None:
        """Read and log the tasks' ``progress.json`` (first :data:`MAX_PROGRESS_TASKS` tasks)."""
        for index in range(min(task_count or 1, MAX_PROGRESS_TASKS)):
            progress = files.progress(index)
            if progress is not None:
                run.progress[str(index)] = progress.to_dict()
                self.log.info("Progress %s", progress.describe())

    def _lost_work(self, run: RunState, task_count: int) -> list[LostWork]:
        """The work lost to each preemption, from the worker's files (empty without a bucket)."""
        files = self._files()
        if files is None:
            return []
        self._log_progress(files, run, task_count)
        lost = [item for index in range(min(task_count, MAX_PROGRESS_TASKS)) for item in files.lost_work(index)]
        for item in lost:
            self.log.warning("Lost work: task %s lost %s steps (attempt %s of %s resumed from step %s)",
                             item["task_index"], item["lost_steps"], item["attempt"], item["execution"],
                             item["resumed_from_step"])
        return lost  # type: ignore[return-value]

    def _copy_container_logs(self, execution: str, finished: bool = False) -> None:
        """With ``log_container_output``: log the execution's new Cloud Logging lines (all of them when
        ``finished``); a failed read is logged as a warning, never raised."""
        if not _flag("log_container_output", self.log_container_output):
            return
        try:
            if self._log_follower is None or self._log_follower.execution != execution:
                hook = CloudRunLogsHook(gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain)
                created = self.hook.get_execution(execution=execution).create_time or None
                self._log_follower = ExecutionLogFollower(hook, execution, since=created)
            lines = self._log_follower.drain() if finished else self._log_follower.read()
        except Exception as exc:  # the task's outcome never depends on its logs
            self.log.warning("Cannot read the container logs of %s (roles/logging.viewer needed): %s", execution, exc)
            return
        for line in lines:
            self.log.info("Container log: %s", line.describe())

    def _goodput(self, run: RunState, failed: bool = False, also: str | None = None,
                 context: Context | None = None) -> GoodputReport | None:
        """Build and log the goodput account of this try's executions (best effort: ``None`` on error).

        :param failed: the try is failing: the steps past each task's newest committed checkpoint
            are counted as wasted, not productive.
        :param also: an execution not in ``run.executions`` to include (the one being cancelled).
        :param context: the account is also pushed as the ``goodput`` XCom (on a failure: the
            summary, which carries it on success, is never returned then).
        """
        try:
            names = [e["name"] for e in run.executions] + ([also] if also and also not in
                                                            {e["name"] for e in run.executions} else [])
            executions = [(name, self.hook.list_tasks(execution=name)) for name in names]
            report = build_report(executions, self._files(), MAX_PROGRESS_TASKS,
                                  unfinished=failed)
        except Exception as exc:  # the account never changes the task's outcome or its error
            self.log.warning("Goodput account not built: %s", exc)
            return None
        self.log.info("Goodput account (seconds and share of each task's span):\n%s\n%s", report["table"],
                      report["headline"])
        if context is not None:
            try:
                context["ti"].xcom_push(key="goodput", value=report)
            except Exception as exc:
                self.log.warning("Goodput account not pushed to XCom: %s", exc)
        return report


def _flag(name: str, value: bool | str) -> bool:
    """A bool, given or rendered from a template (``"true"``/``"false"``, any case).

    :raises ValueError: naming ``name`` for any other value.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"{name}={value!r} must be true or false")


def _execution_class(outcomes: Sequence[TaskOutcome], state: ExecutionState) -> OutcomeClass:
    """A finished execution's class: the outcome :func:`decide` gives it (budget aside)."""
    return decide(outcomes, state=state, reruns_used=0, max_reruns=1).outcome


def _comparable(start: dict[int, int] | None, end: dict[int, int] | None) -> tuple[dict | None, dict | None]:
    """Both step maps in the same form: per task, or both summed (``{-1: sum}``) when one is."""
    if start is None or end is None or (-1 not in start and -1 not in end):
        return start, end
    return {-1: sum(start.values())}, {-1: sum(end.values())}


def _chain(history: Sequence[ExecutionProgress]) -> list[ChainEntry]:
    """The summary's ``chain`` from the progress history."""

    def keyed(steps: Mapping[int, int] | None) -> dict[str, int] | None:
        return None if steps is None else {str(k): v for k, v in sorted(steps.items())}

    return [
        ChainEntry(name=entry.name, index=index, outcome=entry.outcome.value if entry.outcome else None,
                   start_steps=keyed(entry.start_steps), end_steps=keyed(entry.end_steps),
                   progress=entry.made_progress)
        for index, entry in enumerate(history)
    ]


#: The fields of ``RunJobRequest.Overrides`` (Cloud Run Admin API v2).
OVERRIDE_FIELDS = ("container_overrides", "task_count", "timeout")
#: Env var names an override may not set: Cloud Run's own, and the task timeout the worker's
#: deadline follows (set from ``overrides['timeout']`` by the hook, else the job's).
OVERRIDE_RESERVED_ENV = RESERVED_ENV | {TASK_TIMEOUT_ENV}


def check_overrides(overrides: Mapping[str, Any] | None) -> None:
    """Check the execute operator's ``overrides`` as Cloud Run would read them, before any API call.

    :param overrides: ``RunJobRequest.Overrides`` in dict form: ``container_overrides`` (a list of
        ``{name, args, env, clear_args}``), ``task_count`` (an integer >= 0; 0 keeps the job's) and
        ``timeout`` (``"20s"``, ``{"seconds": 20}`` or a ``timedelta``: whole seconds from 1 to
        604800, the job spec's ``task_timeout`` range), or ``None``. The containers' env may not set
        ``CLOUD_RUN_*`` (Cloud Run's) or ``TASK_TIMEOUT_SECONDS`` (set from ``timeout``).
    :raises ValueError: one error naming ``overrides``, the field and the allowed values.
    """
    if overrides is None:
        return
    if not isinstance(overrides, Mapping):
        raise ValueError(f"overrides={overrides!r} must be a dict with the fields {', '.join(OVERRIDE_FIELDS)} "
                         "(RunJobRequest.Overrides), or None")
    unknown = sorted(str(key) for key in overrides if key not in OVERRIDE_FIELDS)
    if unknown:
        raise ValueError(f"overrides has unknown field(s) {', '.join(unknown)}; allowed: {', '.join(OVERRIDE_FIELDS)}")
    for key in OVERRIDE_FIELDS:
        if key not in overrides:
            continue
        try:
            parsed = run_v2.RunJobRequest.Overrides(**{key: overrides[key]})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"overrides[{key!r}]={overrides[key]!r} is not valid: {exc}") from None
        if key == "task_count" and parsed.task_count < 0:
            raise ValueError(f"overrides['task_count']={overrides[key]!r} must be an integer >= 0")
        if key == "timeout" and overrides[key] not in (None, ""):
            seconds = parsed.timeout.total_seconds()
            if not (seconds.is_integer() and 1 <= seconds <= MAX_TASK_TIMEOUT_SECONDS):
                raise ValueError(f"overrides['timeout']={overrides[key]!r} must be a whole number of seconds from 1 to "
                                 f"{MAX_TASK_TIMEOUT_SECONDS} (168 h), e.g. \"3600s\", as the job's task_timeout")
        if key == "container_overrides":
            for index, container in enumerate(parsed.container_overrides):
                taken = sorted({e.name for e in container.env} & OVERRIDE_RESERVED_ENV)
                if taken:
                    raise ValueError(
                        f"overrides['container_overrides'][{index}] sets {', '.join(taken)}: reserved (Cloud Run sets "
                        f"CLOUD_RUN_*; {TASK_TIMEOUT_ENV} follows overrides['timeout'] or the job's task_timeout)")


def _count(name: str, value: int | str) -> int:
    """A non-negative integer, given or rendered from a template (``"3"`` -> 3).

    :raises ValueError: naming ``name`` unless it is an integer >= 0 (a bool is refused too).
    """
    if isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be an integer >= 0")
    return value


def _seconds(name: str, value: float | str) -> float:
    """A number of seconds, given or rendered from a template.

    :raises ValueError: naming ``name`` unless it is a finite number > 0 (a bool is refused too).
    """
    try:
        seconds = float("nan") if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{name}={value!r} must be a positive, finite number of seconds")
    return seconds
