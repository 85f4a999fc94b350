"""Operators that deploy a Cloud Run GPU job and run it to completion through preemptions.

Thin by design: every API call goes through :class:`~airflow_gpu_resilience.hooks.cloud_run.CloudRunGpuHook`,
every validation rule lives in :mod:`~airflow_gpu_resilience.job_spec`, and every decision
about a finished execution in :mod:`~airflow_gpu_resilience.outcome`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from google.api_core import exceptions as gexc
from google.cloud import run_v2

from airflow_gpu_resilience.compat import BaseOperator, default_deferrable

from airflow_gpu_resilience.exceptions import (
    CloudRunGpuExecutionError,
    CloudRunGpuFatalError,
    CloudRunGpuTimeoutError,
    CloudRunGpuWaitTimeout,
)
from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook, execution_env, with_env_overrides
from airflow_gpu_resilience.hooks.progress import CheckpointFilesHook
from airflow_gpu_resilience.job_spec import GpuJobSpec
from airflow_gpu_resilience.links.cloud_run import CloudRunGpuExecutionLink, CloudRunGpuLogsLink
from airflow_gpu_resilience.outcome import (
    DEFAULT_FATAL_EXIT_CODES,
    RESUMABLE,
    Action,
    AttemptRecord,
    ExecutionState,
    OutcomeClass,
    classify_task,
    decide,
    execution_state,
    observe_attempts,
)
from airflow_gpu_resilience.triggers.cloud_run import CloudRunGpuExecutionTrigger, ExecutionEventStatus

if TYPE_CHECKING:
    from airflow_gpu_resilience.compat import Context

#: Container env var that marks an execution with the Airflow task instance that started it.
RUN_KEY_ENV = "AIRFLOW_GPU_RESILIENCE_RUN_KEY"
#: Container env var: ``0`` for a try's first execution, ``n`` for the n-th preemption re-run.
RERUN_ENV = "AIRFLOW_GPU_RESILIENCE_RERUN"
#: Most tasks whose progress files are read (per poll) and whose lost work is reported.
MAX_PROGRESS_TASKS = 16
#: Seconds added to the trigger's timeout for Airflow's own defer timeout.
DEFER_TIMEOUT_MARGIN = 60.0

_SPEC_FIELDS = (
    "image", "command", "args", "env", "cpu", "memory", "gpu_type", "gpu_zonal_redundancy", "task_timeout",
    "max_retries", "task_count", "parallelism", "service_account", "checkpoint_bucket",
    "checkpoint_mount_path", "labels",
)
_INT_FIELDS = ("task_timeout", "max_retries", "task_count", "parallelism")


def _is_templated(value: Any) -> bool:
    if isinstance(value, str):
        return "{{" in value or "{%" in value
    if isinstance(value, Mapping):
        return any(_is_templated(k) or _is_templated(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_is_templated(v) for v in value)
    return False


def _coerce(name: str, value: Any) -> Any:
    """Turn rendered template strings into the spec's types (``"3"`` -> 3, ``"False"`` -> False)."""
    if name in _INT_FIELDS and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if name == "gpu_zonal_redundancy" and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if name in ("service_account", "checkpoint_bucket") and value == "":
        return None
    return value


class CloudRunGpuDeployJobOperator(BaseOperator):
    """Create or update a Cloud Run GPU job from a :class:`~airflow_gpu_resilience.job_spec.GpuJobSpec`.

    Idempotent: a job that already has the desired template is left unchanged. The spec is
    validated when the DAG is parsed if no argument is templated, else at execute, before any
    API call. Returns ``{"job", "job_name", "generation", "action"}`` and pushes the XComs
    ``job_name`` and ``generation``.

    :param job_name: job id (templated).
    :param image: container image (templated).
    :param region: Cloud Run region (default ``us-central1``; templated).
    :param project_id: Google Cloud project; default from the connection (templated).
    :param gcp_conn_id: Airflow connection id (default ``google_cloud_default``; templated).
    :param impersonation_chain: service account (or chain) to impersonate (templated).
    :param transport: ``"rest"``, ``"grpc"`` or ``None`` (chosen from the endpoint).
    :param spec_kwargs: the other :class:`GpuJobSpec` fields (``command``, ``args``, ``env``,
        ``cpu``, ``memory``, ``gpu_type``, ``gpu_zonal_redundancy``, ``task_timeout`` in
        seconds, ``max_retries``, ``task_count``, ``parallelism``, ``service_account``,
        ``checkpoint_bucket``, ``checkpoint_mount_path``, ``labels``), all templated.
    :raises ValueError: at construction (or execute, when templated) for an invalid spec.
    """

    template_fields: Sequence[str] = ("job_name", "region", "project_id", "gcp_conn_id", "impersonation_chain",
                                      *_SPEC_FIELDS)

    def __init__(
        self,
        *,
        job_name: str,
        image: str,
        region: str = "us-central1",
        project_id: str | None = None,
        gcp_conn_id: str = "google_cloud_default",
        impersonation_chain: str | Sequence[str] | None = None,
        transport: Literal["rest", "grpc"] | None = None,
        command: Sequence[str] = (),
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cpu: str = "4",
        memory: str = "16Gi",
        gpu_type: str = "nvidia-l4",
        gpu_zonal_redundancy: bool = False,
        task_timeout: int | str = 3600,
        max_retries: int | str = 3,
        task_count: int | str = 1,
        parallelism: int | str = 0,
        service_account: str | None = None,
        checkpoint_bucket: str | None = None,
        checkpoint_mount_path: str = "/checkpoints",
        labels: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.job_name, self.image, self.region, self.project_id = job_name, image, region, project_id
        self.gcp_conn_id, self.impersonation_chain, self.transport = gcp_conn_id, impersonation_chain, transport
        self.command, self.args, self.env = list(command), list(args), dict(env or {})
        self.cpu, self.memory, self.gpu_type, self.gpu_zonal_redundancy = cpu, memory, gpu_type, gpu_zonal_redundancy
        self.task_timeout, self.max_retries = task_timeout, max_retries
        self.task_count, self.parallelism = task_count, parallelism
        self.service_account, self.checkpoint_bucket = service_account, checkpoint_bucket
        self.checkpoint_mount_path, self.labels = checkpoint_mount_path, dict(labels or {})
        if not any(_is_templated(getattr(self, f)) for f in ("job_name", *_SPEC_FIELDS)):
            self.build_spec()

    def build_spec(self) -> GpuJobSpec:
        """The validated spec from the (rendered) arguments.

        :raises ValueError: for an invalid value, naming the parameter.
        """
        values = {name: _coerce(name, getattr(self, name)) for name in _SPEC_FIELDS}
        return GpuJobSpec(name=self.job_name, **values)

    def execute(self, context: Context) -> dict[str, Any]:
        """Validate, then create or update the job; see the class docstring for the result."""
        spec = self.build_spec()
        hook = CloudRunGpuHook(
            gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain, transport=self.transport
        )
        project_id = self.project_id or hook.project_id
        job, action = hook.create_or_update_job(
            job_name=spec.name, job=spec, region=self.region, project_id=project_id
        )
        self.log.info("Job %s %s (generation %s)", job.name, action, job.generation)
        context["ti"].xcom_push(key="job_name", value=spec.name)
        context["ti"].xcom_push(key="generation", value=int(job.generation))
        return {"job": job.name, "job_name": spec.name, "generation": int(job.generation), "action": action}




class CloudRunGpuExecuteJobOperator(BaseOperator):
    """Run a Cloud Run GPU job until every task succeeds, re-running preempted executions.

    After each execution the operator classifies every task's last attempt
    (:func:`~airflow_gpu_resilience.outcome.classify_task`) and decides
    (:func:`~airflow_gpu_resilience.outcome.decide`):

    - all tasks SUCCEEDED: return the summary (below);
    - only PREEMPTED / TIMED_OUT failures and re-runs left: start a new execution with the same
      overrides (the worker resumes from its checkpoints) and keep waiting;
    - a FAILED task: raise :class:`~airflow_gpu_resilience.exceptions.CloudRunGpuExecutionError`
      (an ``AirflowException``; Airflow's ``retries`` apply) naming exit code and log URI;
    - a FATAL task, a cancelled execution, or the preemption budget exhausted: raise
      :class:`~airflow_gpu_resilience.exceptions.CloudRunGpuFatalError` (an
      ``AirflowFailException``: no Airflow retry).

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

    Summary (returned, so it is the ``return_value`` XCom)::

        {"job", "job_name", "task_count", "outcome": "SUCCEEDED", "reruns",
         "executions": [{"name", "state", "action", "reason", "log_uri", "duration_seconds",
                         "tasks": [TaskOutcome...]}],
         "tasks": [{"index", "attempts", "exit_codes", "outcomes"}],
         "attempts": [{"execution", "task_index", "attempt", "exit_code", "term_signal",
                       "outcome", "message", "duration_seconds"}],
         "preemptions": [the attempts classed PREEMPTED or TIMED_OUT],
         "progress": {task index: TaskProgress...}, "lost_work": [...], "lost_steps_total"}

    ``reruns`` counts every re-run execution of the task instance (all tries). ``tasks[i].attempts``
    counts the attempts of this try's executions (Cloud Run's ``retried + 1`` each);
    ``exit_codes`` and ``outcomes`` list the attempts seen while polling, in order (a signal
    death shows as ``-signal``). An attempt that starts and ends between two polls is counted
    but not listed; the last attempt of each execution is always listed. ``progress`` and
    ``lost_work`` (``[{task_index, execution, attempt, resumed_from_step, lost_steps}]``) are
    read from the worker's ``progress.json`` / ``metrics.json`` only when ``checkpoint_bucket``
    is set; otherwise they are empty.

    :param job_name: job id (templated).
    :param region: Cloud Run region (default ``us-central1``; templated).
    :param project_id: Google Cloud project; default from the connection (templated).
    :param gcp_conn_id: Airflow connection id (default ``google_cloud_default``; templated).
    :param impersonation_chain: service account (or chain) to impersonate (templated).
    :param transport: ``"rest"``, ``"grpc"`` or ``None`` (chosen from the endpoint).
    :param overrides: ``RunJobRequest.Overrides`` in dict form (``container_overrides`` with
        ``args``/``env``, ``task_count``, ``timeout``), applied to every execution, re-runs
        included (templated; default ``None``).
    :param max_preemption_reruns: new executions allowed after preemptions or task timeouts,
        in total over all tries of the task instance; separate from Airflow's ``retries``
        (default 3; an integer >= 0; templated).
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
    :raises ValueError: at construction for a negative ``max_preemption_reruns`` or ``timeout``.
    """

    template_fields: Sequence[str] = (
        "job_name", "region", "project_id", "gcp_conn_id", "impersonation_chain", "overrides",
        "max_preemption_reruns", "checkpoint_bucket", "checkpoint_prefix", "poll_interval",
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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.job_name, self.region, self.project_id = job_name, region, project_id
        self.gcp_conn_id, self.impersonation_chain, self.transport = gcp_conn_id, impersonation_chain, transport
        self.overrides = overrides
        self.max_preemption_reruns = max_preemption_reruns
        self.fatal_exit_codes = sorted(fatal_exit_codes if fatal_exit_codes is not None else DEFAULT_FATAL_EXIT_CODES)
        self.deferrable, self.poll_interval, self.wait_timeout = deferrable, poll_interval, wait_timeout
        self.wait_for_completion = wait_for_completion
        self.timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        self.checkpoint_bucket, self.checkpoint_prefix = checkpoint_bucket, checkpoint_prefix
        self._running_execution: str | None = None
        self._last_progress_log = float("-inf")
        if not isinstance(max_preemption_reruns, str) and (
            isinstance(max_preemption_reruns, bool) or not isinstance(max_preemption_reruns, int)
            or max_preemption_reruns < 0
        ):
            raise ValueError(f"max_preemption_reruns={max_preemption_reruns!r} must be an integer >= 0")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")

    # --- plumbing ------------------------------------------------------------------------
    def _hook(self) -> CloudRunGpuHook:
        return CloudRunGpuHook(
            gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain, transport=self.transport
        )

    def _files(self) -> CheckpointFilesHook | None:
        if not self.checkpoint_bucket:
            return None
        return CheckpointFilesHook(
            self.checkpoint_bucket, self.checkpoint_prefix or self.job_name,
            gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain,
        )

    def _budget(self) -> int:
        value = int(self.max_preemption_reruns)
        if value < 0:
            raise ValueError(f"max_preemption_reruns={value} must be >= 0")
        return value

    def _deadline(self) -> float | None:
        """Epoch seconds when this try must end (``timeout``, else ``execution_timeout``)."""
        limit = self.timeout
        if limit is None and self.execution_timeout is not None:
            limit = self.execution_timeout.total_seconds()
        return None if limit is None else time.time() + limit

    def _wait_limit(self, state: dict) -> tuple[float | None, bool]:
        """``(seconds to wait now, whether that limit is the overall deadline)``."""
        if state.get("deadline") is None:
            return self.wait_timeout, False
        left = max(0.0, state["deadline"] - time.time())
        if self.wait_timeout is not None and self.wait_timeout < left:
            return self.wait_timeout, False
        return left, True

    @staticmethod
    def run_key(context: Context) -> str:
        """Stable id of this task instance (all tries): hash of dag id, run id, task id, map index."""
        ti = context["ti"]
        raw = f"{ti.dag_id}|{ti.run_id}|{ti.task_id}|{getattr(ti, 'map_index', -1)}"
        return hashlib.sha256(raw.encode()).hexdigest()[:32]

    def _reruns_used(self, hook: CloudRunGpuHook, state: dict) -> int:
        """Re-run executions of this task instance so far, counted in Cloud Run (all tries)."""
        executions = hook.find_executions(job_name=self.job_name, region=self.region,
                                          env={RUN_KEY_ENV: state["run_key"]}, project_id=state["project_id"])
        return sum(1 for e in executions if execution_env(e).get(RERUN_ENV, "0") != "0")

    def _start(self, context: Context, hook: CloudRunGpuHook, state: dict, rerun: int) -> str:
        env = {RUN_KEY_ENV: state["run_key"], RERUN_ENV: str(rerun)}
        name = hook.start_execution(
            job_name=self.job_name, region=self.region, project_id=state["project_id"],
            overrides=with_env_overrides(self.overrides, env),
        )
        self.log.info("Started execution %s%s", name, f" (preemption re-run {rerun})" if rerun else "")
        self._remember(context, hook, name)
        return name

    def _remember(self, context: Context, hook: CloudRunGpuHook, name: str) -> None:
        self._running_execution = name
        context["ti"].xcom_push(key="execution_name", value=name)
        log_uri = hook.get_execution(execution=name).log_uri
        CloudRunGpuExecutionLink.persist(context, execution=name)
        CloudRunGpuLogsLink.persist(context, execution=name, log_uri=log_uri)

    # --- execute -------------------------------------------------------------------------
    def execute(self, context: Context) -> dict[str, Any] | None:
        """Attach to this task instance's running execution or start one, then wait.

        :return: the summary (see the class docstring).
        :raises ValueError: ``max_preemption_reruns`` rendered to a negative or non-integer value,
            or ``poll_interval`` to a non-positive one (before any API call).
        :raises CloudRunGpuExecutionError: a task FAILED, or polling hit a non-transient error.
        :raises CloudRunGpuWaitTimeout: ``wait_timeout`` passed (retryable; the next try attaches).
        :raises CloudRunGpuTimeoutError: ``timeout`` passed; the execution was cancelled.
        :raises CloudRunGpuFatalError: FATAL, cancelled, or the preemption budget is exhausted.
        """
        budget = self._budget()
        self.poll_interval = self._seconds("poll_interval", self.poll_interval)
        hook = self._hook()
        project_id = self.project_id or hook.project_id
        state = {"project_id": project_id, "run_key": self.run_key(context), "budget": budget,
                 "deadline": self._deadline(), "executions": [], "attempts": [], "progress": {}}
        result = self._attach_or_start(context, hook, state)
        if isinstance(result, dict):
            return result
        if not self.wait_for_completion:
            self.log.info("Not waiting for %s (wait_for_completion=False)", result)
            return {"execution": result, "job_name": self.job_name}
        return self._wait(context, hook, state, result)

    @staticmethod
    def _seconds(name: str, value: float | str) -> float:
        """A rendered number of seconds; :raises ValueError: naming ``name`` unless it is > 0."""
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = float("nan")
        if not seconds > 0:
            raise ValueError(f"{name}={value!r} must be a positive number of seconds")
        return seconds

    def _attach_or_start(self, context: Context, hook: CloudRunGpuHook, state: dict) -> dict[str, Any] | str:
        """Carry on with an earlier try's newest execution, or start one.

        A still-running execution is attached to. A finished one that no try has acted on yet
        (it ended after a try gave up waiting) is adopted when it succeeded or only lost tasks to
        preemptions or task timeouts: its summary is returned, it is re-run, or the budget is
        reported exhausted. A FAILED, FATAL or CANCELLED one was already acted on (the earlier
        try raised): a new execution starts.

        :return: the summary, or the name of the execution to wait for.
        """
        found = hook.find_executions(job_name=self.job_name, region=self.region,
                                     env={RUN_KEY_ENV: state["run_key"]}, project_id=state["project_id"])
        newest = found[0] if found else None
        if newest is not None and execution_state(newest) is ExecutionState.RUNNING:
            self.log.info("Attaching to execution %s started by an earlier try", newest.name)
            self._remember(context, hook, newest.name)
            return newest.name
        if newest is not None and self._adoptable(hook, state, newest):
            self.log.info("Adopting execution %s: it finished while no try was waiting", newest.name)
            self._remember(context, hook, newest.name)
            return self._after_finish(context, hook, state, newest.name, [])
        return self._start(context, hook, state, rerun=0)

    def _adoptable(self, hook: CloudRunGpuHook, state: dict, execution: run_v2.Execution) -> bool:
        outcomes = [classify_task(t, self.fatal_exit_codes) for t in hook.list_tasks(execution=execution.name)]
        decision = decide(outcomes, state=execution_state(execution), reruns_used=self._reruns_used(hook, state),
                          max_reruns=state["budget"])
        # A FAILED, FATAL or CANCELLED outcome was raised by an earlier try; the others never are
        # before the decision is acted on (a re-run, a summary, or "budget exhausted").
        return decision.outcome in (OutcomeClass.SUCCEEDED, *RESUMABLE)

    def _wait(self, context: Context, hook: CloudRunGpuHook, state: dict, execution: str) -> dict[str, Any]:
        while True:
            limit, overall = self._wait_limit(state)
            state["overall_limit"] = overall
            if self.deferrable:
                self.defer(
                    trigger=CloudRunGpuExecutionTrigger(
                        execution=execution, gcp_conn_id=self.gcp_conn_id,
                        impersonation_chain=self.impersonation_chain, transport=self.transport,
                        poll_interval=self.poll_interval, timeout=limit, carry=state,
                    ),
                    method_name="execute_complete",
                    # The trigger's own timeout fires first; this one covers a lost triggerer.
                    timeout=None if limit is None else timedelta(seconds=limit + DEFER_TIMEOUT_MARGIN),
                )
            attempts = self._poll_until_done(hook, state, execution, limit)
            result = self._after_finish(context, hook, state, execution, attempts)
            if isinstance(result, dict):
                return result
            execution = result

    def _poll_until_done(self, hook: CloudRunGpuHook, state: dict, execution: str, limit: float | None) -> list:
        attempts: list[dict] = []
        seen: set[tuple[int, int]] = set()
        files = self._files()

        def on_poll(current: run_v2.Execution, tasks: list[run_v2.Task]) -> None:
            for record in observe_attempts(tasks, seen):
                seen.add(record.key)
                attempts.append(record.to_dict())
            if files is not None and time.monotonic() - self._last_progress_log >= self.progress_log_interval:
                self._last_progress_log = time.monotonic()
                self._log_progress(files, state, current.task_count)

        try:
            hook.wait_for_execution(execution, poll_interval=self.poll_interval, timeout=limit, on_poll=on_poll)
        except TimeoutError:
            self._timed_out(hook, state, execution, f"still running after {limit:g} s")
        return attempts

    def _log_progress(self, files: CheckpointFilesHook, state: dict, task_count: int) -> None:
        """Read and log the tasks' ``progress.json`` (first :data:`MAX_PROGRESS_TASKS` tasks)."""
        for index in range(min(task_count or 1, MAX_PROGRESS_TASKS)):
            progress = files.progress(index)
            if progress is not None:
                state["progress"][str(index)] = progress.to_dict()
                self.log.info("Progress %s", progress.describe())

    def _timed_out(self, hook: CloudRunGpuHook, state: dict, execution: str, message: str) -> None:
        """Raise for a wait that hit its limit; cancel the execution if it was the overall ``timeout``."""
        self._running_execution = None
        if not state.get("overall_limit"):
            raise CloudRunGpuWaitTimeout(f"Execution {execution} {message}", execution=execution)
        self.log.warning("Overall timeout passed: cancelling execution %s", execution)
        try:
            hook.cancel_execution(execution=execution)
        except gexc.NotFound as exc:  # deleted meanwhile; a finished one is returned unchanged
            self.log.info("Cancel of %s not needed: %s", execution, exc)
        raise CloudRunGpuTimeoutError(
            f"The task's overall timeout passed: execution {execution} {message} and was cancelled "
            f"({len(state['executions'])} earlier execution(s) in this try)",
            execution=execution,
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """Resume after the trigger: decide on the finished execution with a fresh hook.

        :param event: the trigger's event (see :class:`CloudRunGpuExecutionTrigger`).
        :return: the summary, or defers again after starting a re-run.
        :raises CloudRunGpuWaitTimeout: ``wait_timeout`` passed (retryable; the next try attaches
            to the still-running execution).
        :raises CloudRunGpuTimeoutError: ``timeout`` passed; the execution was cancelled.
        :raises CloudRunGpuExecutionError: a task FAILED, or the trigger hit an API error.
        :raises CloudRunGpuFatalError: FATAL, cancelled, or the preemption budget is exhausted.
        """
        execution, status = event["execution"], event["status"]
        state = dict(event["carry"])
        hook = self._hook()
        self._running_execution = execution
        files = self._files()
        if files is not None:
            self._log_progress(files, state, int(hook.get_execution(execution=execution).task_count))
        if status == ExecutionEventStatus.TIMEOUT.value:
            self._timed_out(hook, state, execution, event["message"])
        if status == ExecutionEventStatus.ERROR.value:
            raise CloudRunGpuExecutionError(f"Polling {execution} failed: {event['message']}", execution=execution)
        result = self._after_finish(context, hook, state, execution, list(event.get("attempts") or []))
        if isinstance(result, dict):
            return result
        return self._wait(context, hook, state, result)

    # --- decisions -----------------------------------------------------------------------
    def _after_finish(
        self, context: Context, hook: CloudRunGpuHook, state: dict, execution: str, attempts: list[dict]
    ) -> dict[str, Any] | str:
        """Record the finished execution and act on the decision: a summary, or a new execution name."""
        finished = hook.get_execution(execution=execution)
        tasks = hook.list_tasks(execution=execution)
        seen = {(a["task_index"], a["attempt"]) for a in attempts}
        attempts = attempts + [r.to_dict() for r in observe_attempts(tasks, seen)]
        outcomes = [classify_task(t, self.fatal_exit_codes) for t in tasks]
        reruns_used = self._reruns_used(hook, state)
        decision = decide(
            outcomes, state=execution_state(finished), reruns_used=reruns_used, max_reruns=state["budget"]
        )
        self._record(state, finished, outcomes, attempts, decision)
        self.log.info("Execution %s: %s -> %s", execution, decision.reason, decision.action.value)
        if decision.action is Action.SUCCEED:
            self._running_execution = None
            return self._summary(state, finished, len(tasks), reruns_used)
        if decision.action is Action.RERUN:
            return self._start(context, hook, state, rerun=reruns_used + 1)
        self._running_execution = None
        blamed = decision.blamed
        log_uri = (blamed.log_uri if blamed else "") or finished.log_uri
        message = f"Execution {execution} {decision.outcome.value}: {decision.reason}. Logs: {log_uri}"
        error = CloudRunGpuExecutionError if decision.action is Action.FAIL else CloudRunGpuFatalError
        raise error(
            message, execution=execution, outcome=decision.outcome.value,
            exit_code=blamed.exit_code if blamed else None, log_uri=log_uri,
        )

    def _record(self, state: dict, execution: run_v2.Execution, outcomes: list, attempts: list[dict], decision) -> None:
        """Add the finished execution and its attempts to ``state``; log every attempt."""
        state["executions"].append(
            {
                "name": execution.name,
                "state": execution_state(execution).value,
                "action": decision.action.value,
                "reason": decision.reason,
                "log_uri": execution.log_uri,
                "duration_seconds": _duration(execution),
                "tasks": [o.to_dict() for o in outcomes],
            }
        )
        for raw in attempts:
            record = AttemptRecord.from_dict(raw)
            outcome = record.classify(self.fatal_exit_codes)
            entry = {**record.to_dict(), "execution": execution.name, "outcome": outcome.value}
            state["attempts"].append(entry)
            how = f"signal {record.term_signal}" if record.term_signal else f"exit code {record.exit_code}"
            took = "" if record.duration_seconds is None else f", {record.duration_seconds:g} s"
            log = self.log.warning if outcome in RESUMABLE else self.log.info
            log("Attempt: %s task %s attempt %s: %s (%s%s) %s", execution.name, record.task_index,
                record.attempt, outcome.value, how, took, record.message)

    def _summary(self, state: dict, execution: run_v2.Execution, task_count: int, reruns: int) -> dict[str, Any]:
        per_task: dict[int, dict[str, Any]] = {}

        def entry(index: int) -> dict[str, Any]:
            return per_task.setdefault(index, {"index": index, "attempts": 0, "exit_codes": [], "outcomes": []})

        for ex in state["executions"]:
            for task in ex["tasks"]:
                entry(task["index"])["attempts"] += task["attempts"]
        for attempt in state["attempts"]:
            item = entry(attempt["task_index"])
            item["exit_codes"].append(attempt["exit_code"] if attempt["term_signal"] is None
                                      else -int(attempt["term_signal"]))
            item["outcomes"].append(attempt["outcome"])
        resumable = {c.value for c in RESUMABLE}
        lost = self._lost_work(state, task_count)
        job = execution.name.split("/executions/")[0]
        return {
            "job": job, "job_name": job.rsplit("/", 1)[-1], "task_count": task_count, "outcome": "SUCCEEDED",
            "reruns": reruns, "executions": state["executions"],
            "tasks": [per_task[i] for i in sorted(per_task)], "attempts": state["attempts"],
            "preemptions": [a for a in state["attempts"] if a["outcome"] in resumable],
            "progress": state["progress"], "lost_work": lost,
            "lost_steps_total": sum(item["lost_steps"] for item in lost),
        }

    def _lost_work(self, state: dict, task_count: int) -> list[dict[str, Any]]:
        """The work lost to each preemption, from the worker's files (empty without a bucket)."""
        files = self._files()
        if files is None:
            return []
        self._log_progress(files, state, task_count)
        lost = [item for index in range(min(task_count, MAX_PROGRESS_TASKS)) for item in files.lost_work(index)]
        for item in lost:
            self.log.warning("Lost work: task %s lost %s steps (attempt %s of %s resumed from step %s)",
                             item["task_index"], item["lost_steps"], item["attempt"], item["execution"],
                             item["resumed_from_step"])
        return lost

    def on_kill(self) -> None:
        """Cancel the execution this operator is waiting for (the trigger does so when deferred)."""
        if self._running_execution:
            self.log.info("Cancelling execution %s", self._running_execution)
            self._hook().cancel_execution(execution=self._running_execution)


def _duration(execution: run_v2.Execution) -> float | None:
    if not (execution.start_time and execution.completion_time):
        return None
    return round(max(0.0, (execution.completion_time - execution.start_time).total_seconds()), 3)
