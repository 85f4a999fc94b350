"""Sensor that waits for a Cloud Run execution to finish (poke, reschedule or deferrable)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowSensorTimeout

from airflow_gpu_resilience.exceptions import CloudRunGpuFatalError
from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.outcome import ExecutionState, execution_state
from airflow_gpu_resilience.triggers.cloud_run import CloudRunGpuExecutionTrigger, ExecutionEventStatus

if TYPE_CHECKING:
    from airflow.sdk import Context


class CloudRunGpuExecutionSensor(BaseSensorOperator):
    """Wait until a Cloud Run execution finishes; succeed only if it SUCCEEDED.

    It does not re-run anything (that is the execute operator's job): a FAILED or CANCELLED
    execution fails the sensor without retry (or skips it with ``soft_fail=True``). The XCom
    value is ``{"execution", "state", "succeeded_count", "failed_count", "cancelled_count",
    "task_count"}``.

    :param execution: full execution name, or its short id together with ``job_name`` (templated;
        e.g. ``{{ ti.xcom_pull(task_ids='execute', key='execution_name') }}``).
    :param job_name: job id, only needed for a short ``execution`` (templated).
    :param region: Cloud Run region, only needed for a short ``execution`` (default
        ``us-central1``; templated).
    :param project_id: Google Cloud project; default from the connection (templated).
    :param gcp_conn_id: Airflow connection id (default ``google_cloud_default``; templated).
    :param impersonation_chain: service account (or chain) to impersonate (templated).
    :param transport: ``"rest"``, ``"grpc"`` or ``None`` (chosen from the endpoint).
    :param deferrable: wait in the triggerer instead of poking (default ``False``). The trigger
        polls every ``poke_interval`` seconds and gives up after ``timeout`` seconds.
    :param kwargs: ``BaseSensorOperator`` arguments (``mode``, ``poke_interval`` seconds,
        ``timeout`` seconds, ``soft_fail``, ...).
    """

    template_fields: Sequence[str] = (
        "execution", "job_name", "region", "project_id", "gcp_conn_id", "impersonation_chain",
    )

    def __init__(
        self,
        *,
        execution: str,
        job_name: str | None = None,
        region: str = "us-central1",
        project_id: str | None = None,
        gcp_conn_id: str = "google_cloud_default",
        impersonation_chain: str | Sequence[str] | None = None,
        transport: Literal["rest", "grpc"] | None = None,
        deferrable: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.execution, self.job_name, self.region, self.project_id = execution, job_name, region, project_id
        self.gcp_conn_id, self.impersonation_chain, self.transport = gcp_conn_id, impersonation_chain, transport
        self.deferrable = deferrable

    def _hook(self) -> CloudRunGpuHook:
        return CloudRunGpuHook(
            gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain, transport=self.transport
        )

    def _full_name(self, hook: CloudRunGpuHook) -> str:
        if self.execution.startswith("projects/"):
            return self.execution
        if not self.job_name:
            raise ValueError(f"execution={self.execution!r} is a short name: set job_name too")
        return hook.execution_path(self.project_id or hook.project_id, self.region, self.job_name, self.execution)

    def execute(self, context: Context) -> Any:
        """Poke (or reschedule) as a normal sensor, or defer to the trigger when ``deferrable``."""
        if not self.deferrable:
            return super().execute(context)
        name = self._full_name(self._hook())
        self.defer(
            trigger=CloudRunGpuExecutionTrigger(
                execution=name, gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain,
                transport=self.transport, poll_interval=float(self.poke_interval), timeout=float(self.timeout),
                cancel_on_kill=False,
            ),
            method_name="execute_complete",
            timeout=timedelta(seconds=float(self.timeout)) + timedelta(minutes=1),
        )

    def poke(self, context: Context) -> PokeReturnValue | bool:
        """One check: done when the execution finished.

        :raises CloudRunGpuFatalError: if it FAILED or was CANCELLED.
        """
        hook = self._hook()
        execution = hook.get_execution(execution=self._full_name(hook))
        state = execution_state(execution)
        self.log.info("Execution %s is %s", execution.name, state.value)
        if state is ExecutionState.RUNNING:
            return False
        if state is not ExecutionState.SUCCEEDED:
            raise CloudRunGpuFatalError(
                f"Execution {execution.name} ended {state.value}. Logs: {execution.log_uri}",
                execution=execution.name, outcome=state.value, log_uri=execution.log_uri,
            )
        return PokeReturnValue(is_done=True, xcom_value=self._xcom(execution.name, state, execution))

    @staticmethod
    def _xcom(name: str, state: ExecutionState, execution: Any) -> dict[str, Any]:
        return {
            "execution": name, "state": state.value, "succeeded_count": execution.succeeded_count,
            "failed_count": execution.failed_count, "cancelled_count": execution.cancelled_count,
            "task_count": execution.task_count,
        }

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """Resume after the trigger; re-reads the execution with a fresh hook.

        :raises AirflowSensorTimeout: the trigger timed out.
        :raises CloudRunGpuFatalError: the execution FAILED or was CANCELLED, or polling failed.
        """
        if event["status"] == ExecutionEventStatus.TIMEOUT.value:
            raise AirflowSensorTimeout(f"Execution {event['execution']} {event['message']}")
        if event["status"] != ExecutionEventStatus.SUCCEEDED.value:
            raise CloudRunGpuFatalError(
                f"Execution {event['execution']} ended {event['status']}: {event['message']}",
                execution=event["execution"], outcome=event["status"],
            )
        execution = self._hook().get_execution(execution=event["execution"])
        return self._xcom(execution.name, execution_state(execution), execution)
