"""Sensor that waits for a Cloud Run execution to finish (poke, reschedule or deferrable)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

from airflow.providers.common.compat.sdk import AirflowSensorTimeout, BaseSensorOperator, PokeReturnValue
from google.cloud import run_v2

from airflow_gpu_resilience.compat import default_deferrable

from airflow_gpu_resilience.exceptions import CloudRunGpuFatalError
from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.outcome import (
    DEFAULT_FATAL_EXIT_CODES,
    Action,
    ExecutionState,
    classify_task,
    decide,
    execution_state,
)
from airflow_gpu_resilience.triggers.cloud_run import CloudRunGpuExecutionTrigger, ExecutionEventStatus

if TYPE_CHECKING:
    from airflow.providers.common.compat.sdk import Context


class CloudRunGpuExecutionSensor(BaseSensorOperator):
    """Wait until a Cloud Run execution finishes; succeed only if it SUCCEEDED.

    While the execution runs the sensor keeps waiting, also while Cloud Run retries a preempted
    or failed task inside it (``max_retries``). Once it has finished, every task's last attempt
    is classified as the execute operator does (:func:`~airflow_gpu_resilience.outcome.classify_task`
    and :func:`~airflow_gpu_resilience.outcome.decide`). The sensor re-runs nothing (that is the
    execute operator's job): any outcome but SUCCEEDED fails it without retry with
    :class:`~airflow_gpu_resilience.exceptions.CloudRunGpuFatalError` naming the class, the
    blamed task's exit code and the log URI (or skips it with ``soft_fail=True``).

    The XCom value is ``{"execution", "state", "outcome", "succeeded_count", "failed_count",
    "cancelled_count", "task_count", "tasks": [TaskOutcome...]}``.

    :param execution: full execution name, or its short id together with ``job_name``, or
        ``None`` (default) for the job's newest execution when the sensor starts (in
        ``reschedule`` mode: at each poke) (templated; e.g.
        ``{{ ti.xcom_pull(task_ids='execute', key='execution_name') }}``).
    :param job_name: job id; needed for a short or missing ``execution`` (templated).
    :param region: Cloud Run region, needed with ``job_name`` (default ``us-central1``; templated).
    :param project_id: Google Cloud project; default from the connection (templated).
    :param gcp_conn_id: Airflow connection id (default ``google_cloud_default``; templated).
    :param impersonation_chain: service account (or chain) to impersonate (templated).
    :param transport: ``"rest"``, ``"grpc"`` or ``None`` (chosen from the endpoint).
    :param fatal_exit_codes: exit codes classed FATAL (default 64-78).
    :param deferrable: wait in the triggerer instead of poking (default ``[operators]
        default_deferrable``, which is ``False`` unless the deployment sets it). The trigger
        polls every ``poke_interval`` seconds and gives up after ``timeout`` seconds.
    :param kwargs: ``BaseSensorOperator`` arguments (``mode`` ``poke`` or ``reschedule``,
        ``poke_interval`` seconds (default 60), ``timeout`` seconds (default 7 days), ``soft_fail``, ...).
    :raises ValueError: at execute, for a short or missing ``execution`` without ``job_name``.
    """

    template_fields: Sequence[str] = (
        "execution", "job_name", "region", "project_id", "gcp_conn_id", "impersonation_chain",
    )

    def __init__(
        self,
        *,
        execution: str | None = None,
        job_name: str | None = None,
        region: str = "us-central1",
        project_id: str | None = None,
        gcp_conn_id: str = "google_cloud_default",
        impersonation_chain: str | Sequence[str] | None = None,
        transport: Literal["rest", "grpc"] | None = None,
        fatal_exit_codes: Collection[int] | None = None,
        deferrable: bool = default_deferrable(fallback=False),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.execution, self.job_name, self.region, self.project_id = execution, job_name, region, project_id
        self.gcp_conn_id, self.impersonation_chain, self.transport = gcp_conn_id, impersonation_chain, transport
        self.fatal_exit_codes = sorted(fatal_exit_codes if fatal_exit_codes is not None else DEFAULT_FATAL_EXIT_CODES)
        self.deferrable = deferrable

    @cached_property
    def hook(self) -> CloudRunGpuHook:
        """The Cloud Run hook for this task's connection (built once per operator instance)."""
        return CloudRunGpuHook(
            gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain, transport=self.transport
        )

    def _full_name(self) -> str:
        """The execution's full name; for ``execution=None`` the job's newest.

        :raises ValueError: a short or missing name without ``job_name``, or a job without executions.
        """
        if self.execution and self.execution.startswith("projects/"):
            return self.execution
        if not self.job_name:
            raise ValueError(f"execution={self.execution!r} is a short name or missing: set job_name too")
        project_id = self.project_id or self.hook.project_id
        if self.execution:
            return self.hook.execution_path(project_id, self.region, self.job_name, self.execution)
        executions = self.hook.list_executions(job_name=self.job_name, region=self.region, project_id=project_id)
        if not executions:
            raise ValueError(f"job {self.job_name!r} in {self.region} has no execution to wait for")
        self.execution = executions[0].name
        self.log.info("Waiting for the job's newest execution %s", self.execution)
        return self.execution

    def execute(self, context: Context) -> Any:
        """Poke (or reschedule) as a normal sensor, or defer to the trigger when ``deferrable``."""
        if not self.deferrable:
            return super().execute(context)
        trigger = CloudRunGpuExecutionTrigger(
            execution=self._full_name(), gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain,
            transport=self.transport, poll_interval=float(self.poke_interval), timeout=float(self.timeout),
            cancel_on_kill=False,
        )
        self.defer(trigger=trigger, method_name="execute_complete", timeout=trigger.defer_timeout)

    def poke(self, context: Context) -> PokeReturnValue | bool:
        """One check: done when the execution finished.

        :raises CloudRunGpuFatalError: if it ended in any outcome but SUCCEEDED.
        """
        execution = self.hook.get_execution(execution=self._full_name())
        state = execution_state(execution)
        self.log.info("Execution %s is %s", execution.name, state.value)
        if state is ExecutionState.RUNNING:
            return False
        return PokeReturnValue(is_done=True, xcom_value=self._finished(execution))

    def _finished(self, execution: run_v2.Execution) -> dict[str, Any]:
        """Classify a finished execution: its XCom value, or raise for any outcome but SUCCEEDED."""
        state = execution_state(execution)
        outcomes = [classify_task(t, self.fatal_exit_codes) for t in self.hook.list_tasks(execution=execution.name)]
        decision = decide(outcomes, state=state, reruns_used=0, max_reruns=0)
        if decision.action is not Action.SUCCEED:
            head = f"Execution {execution.name} ended {state.value} ({decision.outcome.value})"
            raise CloudRunGpuFatalError.for_decision(head, decision, execution)
        return {
            "execution": execution.name, "state": state.value, "outcome": decision.outcome.value,
            "succeeded_count": execution.succeeded_count, "failed_count": execution.failed_count,
            "cancelled_count": execution.cancelled_count, "task_count": execution.task_count,
            "tasks": [o.to_dict() for o in outcomes],
        }

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """Resume after the trigger; re-reads and classifies the execution with a fresh hook.

        :raises AirflowSensorTimeout: the trigger timed out.
        :raises CloudRunGpuFatalError: the execution ended in any outcome but SUCCEEDED, or
            polling hit a non-transient API error.
        """
        if event["status"] == ExecutionEventStatus.TIMEOUT.value:
            raise AirflowSensorTimeout(f"Execution {event['execution']} {event['message']}")
        if event["status"] == ExecutionEventStatus.ERROR.value:
            raise CloudRunGpuFatalError(
                f"Polling execution {event['execution']} failed: {event['message']}",
                execution=event["execution"], outcome=event["status"],
            )
        return self._finished(self.hook.get_execution(execution=event["execution"]))
