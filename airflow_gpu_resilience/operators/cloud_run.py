"""Operators that deploy a Cloud Run GPU job and run it to completion through preemptions.

Thin by design, they keep Airflow's side (``context``, XCom, links, deferral): API calls go through
:class:`~airflow_gpu_resilience.hooks.cloud_run.CloudRunGpuHook`, argument rules live in
:mod:`~airflow_gpu_resilience.job_spec`, :mod:`~airflow_gpu_resilience.overrides` and
:mod:`~airflow_gpu_resilience.operator_args`, and the watching and re-running in
:class:`~airflow_gpu_resilience.run_manager.CloudRunGpuRunManager`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import time
from collections.abc import Collection, Sequence
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

from airflow.providers.common.compat.sdk import BaseOperator

from airflow_gpu_resilience.compat import default_deferrable
from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.job_spec import GpuJobSpec
from airflow_gpu_resilience.links.cloud_run import CloudRunGpuExecutionLink, CloudRunGpuLogsLink
from airflow_gpu_resilience.operator_args import (
    SPEC_FIELDS, coerce_spec_value, is_templated, parse_execute_arguments, parse_seconds, spec_default,
    with_spec_parameters,
)
from airflow_gpu_resilience.outcome import DEFAULT_FATAL_EXIT_CODES
from airflow_gpu_resilience.rerun_budget import DEFAULT_MAX_RERUNS_WITHOUT_PROGRESS, DEFAULT_MAX_TOTAL_RERUNS
from airflow_gpu_resilience.run_manager import CloudRunGpuRunManager
from airflow_gpu_resilience.run_state import (  # RunSummary and its parts: the execute operator's result
    DEFAULT_PROGRESS_READ_TIMEOUT, RERUN_ENV, RUN_KEY_ENV, START_STEPS_ENV, AttemptEntry, ChainEntry, ExecutionEntry,
    LostWork, RunSettings, RunState, RunStep, RunSummary, TaskSummary,
)
from airflow_gpu_resilience.triggers.cloud_run import CloudRunGpuExecutionTrigger

if TYPE_CHECKING:
    from airflow.providers.common.compat.sdk import Context

#: Public API, also for existing users of this module: the operators, the env vars that mark an
#: execution, and the run state and summary types (defined in :mod:`~airflow_gpu_resilience.run_state`).
__all__ = [
    "RERUN_ENV", "RUN_KEY_ENV", "START_STEPS_ENV", "AttemptEntry", "ChainEntry", "CloudRunGpuDeployJobOperator",
    "CloudRunGpuExecuteJobOperator", "ExecutionEntry", "LostWork", "RunState", "RunStep", "RunSummary", "TaskSummary",
]


# --- the deploy operator ----------------------------------------------------------------------
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
                                      *(f.name for f in SPEC_FIELDS))

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
        spec_values = {f.name: kwargs.pop(f.name, spec_default(f)) for f in SPEC_FIELDS}
        super().__init__(**kwargs)
        if not isinstance(adopt_existing_job, bool):
            raise ValueError(f"adopt_existing_job={adopt_existing_job!r} must be True or False")
        self.job_name, self.region, self.project_id = job_name, region, project_id
        self.gcp_conn_id, self.impersonation_chain, self.transport = gcp_conn_id, impersonation_chain, transport
        self.adopt_existing_job = adopt_existing_job
        for spec_field in SPEC_FIELDS:
            value = spec_values[spec_field.name]
            if value is inspect.Parameter.empty:
                raise TypeError(f"{type(self).__name__} needs the keyword argument {spec_field.name!r}")
            if value is None and spec_field.default_factory is not dataclasses.MISSING:  # env=None, labels=None
                value = spec_field.default_factory()
            setattr(self, spec_field.name, list(value) if isinstance(value, tuple) else value)
        if not any(is_templated(getattr(self, f)) for f in ("job_name", *spec_values)):
            self.build_spec()

    __init__.__signature__ = with_spec_parameters(__init__)  # type: ignore[attr-defined]

    def build_spec(self) -> GpuJobSpec:
        """The validated spec from the (rendered) arguments.

        :raises ValueError: for an invalid value, naming the parameter.
        """
        values = {f.name: coerce_spec_value(f.name, getattr(self, f.name)) for f in SPEC_FIELDS}
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
#: The execute operator's arguments checked by :func:`~airflow_gpu_resilience.operator_args.parse_execute_arguments`,
#: and those of them also checked when the DAG is parsed.
_CHECKED = ("job_name", "project_id", "region", "checkpoint_bucket", "fatal_exit_codes", "max_preemption_reruns",
            "max_reruns_without_progress", "max_total_reruns", "poll_interval", "log_container_output", "overrides",
            "timeout", "wait_timeout", "progress_read_timeout")
_PARSE_TIME = tuple(name for name in _CHECKED if name != "overrides")


class CloudRunGpuExecuteJobOperator(BaseOperator):
    """Run a Cloud Run GPU job until every task succeeds, re-running preempted executions.

    After each execution it classifies every task's last attempt
    (:func:`~airflow_gpu_resilience.outcome.classify_task`) and acts on
    :func:`~airflow_gpu_resilience.outcome.decide`: all tasks SUCCEEDED: return the
    :class:`RunSummary` (the ``return_value`` XCom, with the try's goodput account); only
    PREEMPTED / TIMED_OUT failures and re-runs left: start a new execution with the same overrides
    (the worker resumes from its checkpoints); a FAILED task: raise
    :class:`~airflow_gpu_resilience.exceptions.CloudRunGpuExecutionError` (Airflow's ``retries``
    apply); FATAL, cancelled, or the re-run budget exhausted: raise
    :class:`~airflow_gpu_resilience.exceptions.CloudRunGpuFatalError` (no retry). It waits in the
    worker (:meth:`execute_sync`) or in the triggerer (:meth:`execute_async`, then
    :meth:`execute_complete`). The re-run budget, and how a new try attaches to or adopts an
    earlier try's execution: :mod:`~airflow_gpu_resilience.run_manager`.

    :param job_name: job id (templated).
    :param region: Cloud Run region (default ``us-central1``; templated).
    :param project_id: Google Cloud project; default from the connection (templated).
    :param gcp_conn_id: Airflow connection id (default ``google_cloud_default``; templated).
    :param impersonation_chain: service account (or chain) to impersonate (templated).
    :param transport: ``"rest"``, ``"grpc"`` or ``None`` (chosen from the endpoint).
    :param overrides: ``RunJobRequest.Overrides`` in dict form (``container_overrides`` with
        ``args``/``env``, ``task_count``, ``timeout``), applied to every execution, re-runs
        included (templated; default ``None``).
    :param max_preemption_reruns: without ``checkpoint_bucket``, the fixed budget: new executions
        allowed after preemptions or task timeouts, in total over all tries of the task instance,
        separate from Airflow's ``retries``; with it, the executions whose progress stays unknown
        (the bucket unreadable) passed over before they count as without progress (default 3; an
        integer >= 0; templated).
    :param max_reruns_without_progress: consecutive re-runs that commit no new checkpoint before
        the task fails without retry (default 2; an integer >= 0; templated). Used with
        ``checkpoint_bucket``.
    :param max_total_reruns: re-runs allowed in total with ``checkpoint_bucket``, with or without
        progress: a cost cap (default 48, enough for a day on the one-hour GA GPU task timeout
        with a preemption every hour; an integer >= 0; templated).
    :param fatal_exit_codes: exit codes that fail without retry (integers 1-255; default 64-78, BSD sysexits).
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
    :param checkpoint_prefix: folder of the task folders in the bucket (default: the job name,
        plus ``/{CHECKPOINT_RUN_ID}`` when the job sets that variable, as the worker does; templated).
    :param progress_read_timeout: seconds a read of the committed checkpoint steps (at each start
        and re-run decision) retries a bucket that cannot be read, with backoff, before the
        progress counts as unknown (default 300; > 0).
    :param log_container_output: copy the execution's container and platform log lines (the
        worker's "SIGTERM received ...", the maintenance message) from Cloud Logging into the task
        log, each line once (default ``False``: no Logging call; templated: a bool, or
        ``"true"``/``"false"``). Needs ``roles/logging.viewer``; at most 12 ``entries:list``
        requests a minute (:class:`~airflow_gpu_resilience.hooks.cloud_logging.ExecutionLogFollower`).
        Polling in the worker, lines appear while waiting; deferred, when the operator resumes.
    :raises ValueError: one error naming the argument and the allowed values, at construction for
        a value given, else at execute once rendered, before any API call
        (:func:`~airflow_gpu_resilience.operator_args.parse_execute_arguments`).
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
        progress_read_timeout: float = DEFAULT_PROGRESS_READ_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.job_name, self.region, self.project_id = job_name, region, project_id
        self.gcp_conn_id, self.impersonation_chain, self.transport = gcp_conn_id, impersonation_chain, transport
        self.overrides = overrides
        self.max_preemption_reruns = max_preemption_reruns
        self.max_reruns_without_progress, self.max_total_reruns = max_reruns_without_progress, max_total_reruns
        self.fatal_exit_codes = DEFAULT_FATAL_EXIT_CODES if fatal_exit_codes is None else fatal_exit_codes
        self.deferrable, self.poll_interval, self.wait_timeout = deferrable, poll_interval, wait_timeout
        self.wait_for_completion = wait_for_completion
        self.timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        self.checkpoint_bucket, self.checkpoint_prefix = checkpoint_bucket, checkpoint_prefix
        self.progress_read_timeout = progress_read_timeout
        self.log_container_output: bool | str = log_container_output
        self._manager: CloudRunGpuRunManager | None = None
        # checked when the DAG is parsed, templates once rendered (at execute, with the rest)
        for name, value in parse_execute_arguments({name: getattr(self, name) for name in _PARSE_TIME},
                                                   templated=self.template_fields).items():
            setattr(self, name, value)

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
        :raises ValueError: an argument rendered to a value Cloud Run or this operator refuses
            (``overrides``: :func:`~airflow_gpu_resilience.overrides.check_overrides`), before any API call.
        :raises CloudRunGpuExecutionError: a task FAILED, or polling hit a non-transient error.
        :raises CloudRunGpuWaitTimeout: ``wait_timeout`` passed (retryable; the next try attaches).
        :raises CloudRunGpuTimeoutError: ``timeout`` passed; the execution was cancelled.
        :raises CloudRunGpuFatalError: FATAL, cancelled, or the preemption budget is exhausted.
        """
        ti = context.get("ti")
        manager = self.run_manager(ti)  # every argument checked as rendered, before any API call
        run = manager.new_run(self.project_id or self.hook.project_id, self.run_key(ti), self._deadline())
        step = manager.attach_or_start(run)
        if step.execution is not None and not self.wait_for_completion:
            self.log.info("Not waiting for %s (wait_for_completion=False)", step.execution)
            return {"execution": step.execution, "job_name": self.job_name}
        return self.execute_async(run, step) if self.deferrable else self.execute_sync(run, step)

    def execute_sync(self, run: RunState, step: RunStep) -> RunSummary:
        """Poll in the worker until the run is done, re-running after preemptions.

        :param run: this try's state.
        :param step: the execution to wait for first (or the summary, returned at once).
        :return: the summary; raises as :meth:`execute` does.
        """
        return self._built_manager().run_to_end(run, step)

    def execute_async(self, run: RunState, step: RunStep) -> RunSummary:
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
            transport=self.transport, poll_interval=parse_seconds("poll_interval", self.poll_interval),
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
        run = RunState.from_dict(event["carry"])
        return self.execute_async(run, self.run_manager(context["ti"]).resume(run, event))

    def on_kill(self) -> None:
        """Cancel the execution this operator is waiting for (the trigger does so when deferred)."""
        execution = self._manager.running_execution if self._manager is not None else None
        if execution:
            self.log.info("Cancelling execution %s", execution)
            self.hook.cancel_execution(execution=execution)

    # --- what the run manager is given -----------------------------------------------------
    @staticmethod
    def run_key(ti: Any) -> str:
        """Stable id of the task instance ``ti`` (all its tries): hash of dag id, run id, task id, map index."""
        raw = f"{ti.dag_id}|{ti.run_id}|{ti.task_id}|{getattr(ti, 'map_index', -1)}"
        return hashlib.sha256(raw.encode()).hexdigest()[:32]

    def run_manager(self, ti: Any) -> CloudRunGpuRunManager:
        """The run manager of this operator instance (built once); it publishes to ``ti``.

        :param ti: the running task instance: each execution started is pushed to its XCom
            (``execution_name``, the two extra links), and a failed try's goodput account (``goodput``).

        :raises ValueError: an argument rendered to a bad value
            (:func:`~airflow_gpu_resilience.operator_args.parse_execute_arguments`).
        """
        if self._manager is None:
            checked = parse_execute_arguments({name: getattr(self, name) for name in _CHECKED})
            fields = {f.name for f in dataclasses.fields(RunSettings)}  # timeout, project_id: not the manager's
            settings = RunSettings(**{name: getattr(self, name) for name in fields - set(_CHECKED)},
                                   **{name: value for name, value in checked.items() if name in fields})

            def remember(execution: str, log_uri: str) -> None:
                ti.xcom_push(key="execution_name", value=execution)
                CloudRunGpuExecutionLink.push(ti, execution=execution)
                CloudRunGpuLogsLink.push(ti, execution=execution, log_uri=log_uri)

            self._manager = CloudRunGpuRunManager(
                self.hook, settings, log=self.log, on_execution=remember,
                on_failure_goodput=lambda report: ti.xcom_push(key="goodput", value=report))
        return self._manager

    def _built_manager(self) -> CloudRunGpuRunManager:
        """The run manager :meth:`execute` built (:meth:`run_manager`)."""
        if self._manager is None:
            raise RuntimeError("the run manager is built by execute() first")
        return self._manager

    def _deadline(self) -> float | None:
        """Epoch seconds when this try must end (``timeout``, else ``execution_timeout``)."""
        limit = self.timeout
        if limit is None and self.execution_timeout is not None:
            limit = self.execution_timeout.total_seconds()
        return None if limit is None else time.time() + limit
