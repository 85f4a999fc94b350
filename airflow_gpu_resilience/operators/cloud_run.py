"""Operators that deploy a Cloud Run GPU job and run it to completion through preemptions.

Thin by design: every API call goes through :class:`~airflow_gpu_resilience.hooks.cloud_run.CloudRunGpuHook`,
every validation rule lives in :mod:`~airflow_gpu_resilience.job_spec`, and every decision
about a finished execution in :mod:`~airflow_gpu_resilience.outcome`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from google.cloud import run_v2

from airflow.sdk import BaseOperator

from airflow_gpu_resilience.exceptions import (
    CloudRunGpuExecutionError,
    CloudRunGpuFatalError,
    CloudRunGpuWaitTimeout,
)
from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.job_spec import GpuJobSpec
from airflow_gpu_resilience.links.cloud_run import CloudRunGpuExecutionLink, CloudRunGpuLogsLink
from airflow_gpu_resilience.outcome import (
    DEFAULT_FATAL_EXIT_CODES,
    RESUMABLE,
    Action,
    AttemptRecord,
    ExecutionState,
    classify_task,
    decide,
    execution_state,
    observe_attempts,
)
from airflow_gpu_resilience.triggers.cloud_run import CloudRunGpuExecutionTrigger, ExecutionEventStatus

if TYPE_CHECKING:
    from airflow.sdk import Context

#: Container env var that marks an execution with the Airflow task instance that started it.
RUN_KEY_ENV = "AIRFLOW_GPU_RESILIENCE_RUN_KEY"

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
    - only PREEMPTED / TIMED_OUT failures and re-runs left: start a new execution (the worker
      resumes from its checkpoints) and keep waiting;
    - a FAILED task: raise :class:`~airflow_gpu_resilience.exceptions.CloudRunGpuExecutionError`
      (an ``AirflowException``; Airflow's ``retries`` apply) naming exit code and log URI;
    - a FATAL task, a cancelled execution, or the preemption budget exhausted: raise
      :class:`~airflow_gpu_resilience.exceptions.CloudRunGpuFatalError` (an
      ``AirflowFailException``: no Airflow retry).

    Idempotent across Airflow retries: each execution carries the env var
    ``AIRFLOW_GPU_RESILIENCE_RUN_KEY`` (a hash of dag id, run id, task id and map index); a new
    try first attaches to a still-running execution with its key instead of starting another.

    Summary (returned, so it is the ``return_value`` XCom)::

        {"job", "job_name", "task_count", "outcome": "SUCCEEDED", "reruns",
         "executions": [{"name", "state", "action", "reason", "log_uri", "tasks": [TaskOutcome...]}],
         "tasks": [{"index", "attempts", "exit_codes", "outcomes"}],
         "preemptions": [{"execution", "task_index", "attempt", "exit_code", "term_signal",
                          "outcome", "message"}]}

    ``tasks[i].attempts`` counts every attempt across executions (Cloud Run's ``retried + 1``
    per execution); ``exit_codes`` and ``outcomes`` list the attempts seen while polling, in
    order (a signal death shows as ``-signal``). An attempt that starts and ends between two
    polls is counted but not listed; the last attempt of each execution is always listed.
    ``preemptions`` are the seen attempts classed PREEMPTED or TIMED_OUT, each also logged as a
    warning. The budget is per Airflow try: a retry (or attach) starts again at 0 re-runs.

    :param job_name: job id (templated).
    :param region: Cloud Run region (default ``us-central1``; templated).
    :param project_id: Google Cloud project; default from the connection (templated).
    :param gcp_conn_id: Airflow connection id (default ``google_cloud_default``; templated).
    :param impersonation_chain: service account (or chain) to impersonate (templated).
    :param transport: ``"rest"``, ``"grpc"`` or ``None`` (chosen from the endpoint).
    :param overrides: ``RunJobRequest.Overrides`` in dict form (``container_overrides`` with
        ``args``/``env``, ``task_count``, ``timeout``), applied to every execution (templated).
    :param max_preemption_reruns: new executions allowed after preemptions or timeouts
        (default 3; templated).
    :param fatal_exit_codes: exit codes that fail without retry (default 64-78).
    :param deferrable: wait in the triggerer (default ``True``); ``False`` polls in the worker.
    :param poll_interval: seconds between polls (default 10).
    :param wait_timeout: seconds to wait for one execution before failing (retryable; the next
        try attaches to it); default ``None`` waits as long as it runs.
    """

    template_fields: Sequence[str] = (
        "job_name", "region", "project_id", "gcp_conn_id", "impersonation_chain", "overrides",
        "max_preemption_reruns",
    )
    template_fields_renderers = {"overrides": "json"}
    operator_extra_links = (CloudRunGpuExecutionLink(), CloudRunGpuLogsLink())

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
        deferrable: bool = True,
        poll_interval: float = 10.0,
        wait_timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.job_name, self.region, self.project_id = job_name, region, project_id
        self.gcp_conn_id, self.impersonation_chain, self.transport = gcp_conn_id, impersonation_chain, transport
        self.overrides = overrides
        self.max_preemption_reruns = max_preemption_reruns
        self.fatal_exit_codes = sorted(fatal_exit_codes if fatal_exit_codes is not None else DEFAULT_FATAL_EXIT_CODES)
        self.deferrable, self.poll_interval, self.wait_timeout = deferrable, poll_interval, wait_timeout
        self._running_execution: str | None = None
        if not isinstance(max_preemption_reruns, str) and (
            isinstance(max_preemption_reruns, bool) or not isinstance(max_preemption_reruns, int)
            or max_preemption_reruns < 0
        ):
            raise ValueError(f"max_preemption_reruns={max_preemption_reruns!r} must be an integer >= 0")

    # --- plumbing ------------------------------------------------------------------------
    def _hook(self) -> CloudRunGpuHook:
        return CloudRunGpuHook(
            gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain, transport=self.transport
        )

    def _budget(self) -> int:
        value = int(self.max_preemption_reruns)
        if value < 0:
            raise ValueError(f"max_preemption_reruns={value} must be >= 0")
        return value

    @staticmethod
    def run_key(context: Context) -> str:
        """Stable id of this task instance (all tries): hash of dag id, run id, task id, map index."""
        ti = context["ti"]
        raw = f"{ti.dag_id}|{ti.run_id}|{ti.task_id}|{getattr(ti, 'map_index', -1)}"
        return hashlib.sha256(raw.encode()).hexdigest()[:32]

    def _overrides_with_key(self, key: str) -> dict[str, Any]:
        overrides = dict(self.overrides or {})
        containers = [dict(c) for c in overrides.get("container_overrides", [])] or [{}]
        containers[0]["env"] = [*containers[0].get("env", []), {"name": RUN_KEY_ENV, "value": key}]
        overrides["container_overrides"] = containers
        return overrides

    def _find_running(self, hook: CloudRunGpuHook, project_id: str, key: str) -> run_v2.Execution | None:
        for execution in hook.list_executions(job_name=self.job_name, region=self.region, project_id=project_id):
            if execution_state(execution) is not ExecutionState.RUNNING:
                continue
            env = {e.name: e.value for c in execution.template.containers for e in c.env}
            if env.get(RUN_KEY_ENV) == key:
                return execution
        return None

    def _start(self, context: Context, hook: CloudRunGpuHook, project_id: str) -> str:
        _, name = hook.run_job(
            job_name=self.job_name, region=self.region, project_id=project_id,
            overrides=self._overrides_with_key(self.run_key(context)),
        )
        self.log.info("Started execution %s", name)
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
        :raises CloudRunGpuExecutionError: a task FAILED (retryable) or waiting timed out.
        :raises CloudRunGpuFatalError: FATAL, cancelled, or the preemption budget is exhausted.
        """
        budget = self._budget()
        hook = self._hook()
        project_id = self.project_id or hook.project_id
        running = self._find_running(hook, project_id, self.run_key(context))
        if running is not None:
            self.log.info("Attaching to execution %s started by an earlier try", running.name)
            self._remember(context, hook, running.name)
            execution = running.name
        else:
            execution = self._start(context, hook, project_id)
        state = {"project_id": project_id, "budget": budget, "reruns": 0, "executions": [], "attempts": []}
        return self._wait(context, hook, state, execution)

    def _wait(self, context: Context, hook: CloudRunGpuHook, state: dict, execution: str) -> dict[str, Any]:
        while True:
            if self.deferrable:
                self.defer(
                    trigger=CloudRunGpuExecutionTrigger(
                        execution=execution, gcp_conn_id=self.gcp_conn_id,
                        impersonation_chain=self.impersonation_chain, transport=self.transport,
                        poll_interval=self.poll_interval, timeout=self.wait_timeout, carry=state,
                    ),
                    method_name="execute_complete",
                )
            attempts = self._poll_until_done(hook, execution)
            result = self._after_finish(context, hook, state, execution, attempts)
            if isinstance(result, dict):
                return result
            execution = result

    def _poll_until_done(self, hook: CloudRunGpuHook, execution: str) -> list[dict]:
        attempts: list[dict] = []
        seen: set[tuple[int, int]] = set()

        def on_poll(_: run_v2.Execution, tasks: list[run_v2.Task]) -> None:
            for record in observe_attempts(tasks, seen):
                seen.add(record.key)
                attempts.append(record.to_dict())

        try:
            hook.wait_for_execution(execution, poll_interval=self.poll_interval, timeout=self.wait_timeout,
                                    on_poll=on_poll)
        except TimeoutError as exc:
            raise CloudRunGpuWaitTimeout(str(exc), execution=execution) from exc
        return attempts

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """Resume after the trigger: decide on the finished execution with a fresh hook.

        :param event: the trigger's event (see :class:`CloudRunGpuExecutionTrigger`).
        :return: the summary, or defers again after starting a re-run.
        :raises CloudRunGpuWaitTimeout: the trigger's ``timeout`` passed (retryable; the next try
            attaches to the still-running execution).
        :raises CloudRunGpuExecutionError: a task FAILED, or the trigger hit an API error.
        :raises CloudRunGpuFatalError: FATAL, cancelled, or the preemption budget is exhausted.
        """
        execution, status = event["execution"], event["status"]
        if status == ExecutionEventStatus.TIMEOUT.value:
            raise CloudRunGpuWaitTimeout(f"Execution {execution} {event['message']}", execution=execution)
        if status == ExecutionEventStatus.ERROR.value:
            raise CloudRunGpuExecutionError(f"Polling {execution} failed: {event['message']}", execution=execution)
        hook = self._hook()
        state = dict(event["carry"])
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
        decision = decide(
            outcomes, state=execution_state(finished), reruns_used=state["reruns"], max_reruns=state["budget"]
        )
        self._record(state, finished, outcomes, attempts, decision)
        self.log.info("Execution %s: %s -> %s", execution, decision.reason, decision.action.value)
        if decision.action is Action.SUCCEED:
            self._running_execution = None
            return self._summary(state, finished, len(tasks))
        if decision.action is Action.RERUN:
            state["reruns"] += 1
            return self._start(context, hook, state["project_id"])
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
        state["executions"].append(
            {
                "name": execution.name,
                "state": execution_state(execution).value,
                "action": decision.action.value,
                "reason": decision.reason,
                "log_uri": execution.log_uri,
                "tasks": [o.to_dict() for o in outcomes],
            }
        )
        for raw in attempts:
            record = AttemptRecord.from_dict(raw)
            outcome = record.classify(self.fatal_exit_codes)
            entry = {**record.to_dict(), "execution": execution.name, "outcome": outcome.value}
            state["attempts"].append(entry)
            if outcome in RESUMABLE:
                how = f"signal {record.term_signal}" if record.term_signal else f"exit code {record.exit_code}"
                self.log.warning(
                    "%s: task %s attempt %s in %s (%s): %s", outcome.value, record.task_index, record.attempt,
                    execution.name, how, record.message,
                )

    def _summary(self, state: dict, execution: run_v2.Execution, task_count: int) -> dict[str, Any]:
        per_task: dict[int, dict[str, Any]] = {}
        for ex in state["executions"]:
            for task in ex["tasks"]:
                entry = per_task.setdefault(task["index"], {"index": task["index"], "attempts": 0,
                                                            "exit_codes": [], "outcomes": []})
                entry["attempts"] += task["attempts"]
        for attempt in state["attempts"]:
            entry = per_task.setdefault(attempt["task_index"], {"index": attempt["task_index"], "attempts": 0,
                                                                "exit_codes": [], "outcomes": []})
            entry["exit_codes"].append(attempt["exit_code"] if attempt["term_signal"] is None
                                       else -int(attempt["term_signal"]))
            entry["outcomes"].append(attempt["outcome"])
        preemptions = [
            {k: a[k] for k in ("execution", "task_index", "attempt", "exit_code", "term_signal", "outcome", "message")}
            for a in state["attempts"] if a["outcome"] in {c.value for c in RESUMABLE}
        ]
        job = execution.name.split("/executions/")[0]
        return {
            "job": job, "job_name": job.rsplit("/", 1)[-1], "task_count": task_count, "outcome": "SUCCEEDED",
            "reruns": state["reruns"], "executions": state["executions"],
            "tasks": [per_task[i] for i in sorted(per_task)], "preemptions": preemptions,
        }

    def on_kill(self) -> None:
        """Cancel the execution this operator is waiting for (the trigger does so when deferred)."""
        if self._running_execution:
            self.log.info("Cancelling execution %s", self._running_execution)
            self._hook().cancel_execution(execution=self._running_execution)
