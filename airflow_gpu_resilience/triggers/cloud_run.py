"""Async trigger that waits for a Cloud Run execution to finish."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from google.api_core import exceptions as gexc

from airflow_gpu_resilience.compat import BaseTrigger, TriggerEvent

from airflow_gpu_resilience.hooks.cloud_run import TRANSIENT_ERRORS, CloudRunGpuAsyncHook
from airflow_gpu_resilience.outcome import ExecutionState, execution_state, observe_attempts

#: Most attempt records one event carries (keeps events small; the oldest are kept).
MAX_ATTEMPT_RECORDS = 200


class ExecutionEventStatus(str, enum.Enum):
    """``status`` of a :class:`CloudRunGpuExecutionTrigger` event."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    ERROR = "error"


_STATUS_OF = {
    ExecutionState.SUCCEEDED: ExecutionEventStatus.SUCCEEDED,
    ExecutionState.FAILED: ExecutionEventStatus.FAILED,
    ExecutionState.CANCELLED: ExecutionEventStatus.CANCELLED,
}


class CloudRunGpuExecutionTrigger(BaseTrigger):
    """Poll a Cloud Run execution until it finishes; yield one small JSON event.

    The event is ``{"status", "execution", "message", "attempts", "carry"}``:

    - ``status``: an :class:`ExecutionEventStatus` value (``succeeded``, ``failed``,
      ``cancelled``, ``timeout`` when ``timeout`` passed first, ``error`` for a non-transient
      API error);
    - ``execution``: the full execution name;
    - ``message``: the execution's ``Completed`` condition message or the error;
    - ``attempts``: finished task attempts seen while polling
      (:meth:`~airflow_gpu_resilience.outcome.AttemptRecord.to_dict`), at most 200;
    - ``carry``: the ``carry`` argument, unchanged (state the operator needs back).

    The classification of the tasks is left to the operator, which re-reads them with a fresh
    hook; transient API errors (503, 429, deadline, a broken connection, and the hook's
    retries giving up) are retried at the next poll and never end the wait.

    :param execution: full execution name.
    :param gcp_conn_id: Airflow connection id (default ``google_cloud_default``).
    :param impersonation_chain: service account (or chain) to impersonate, or ``None``.
    :param transport: ``"rest"``, ``"grpc"`` or ``None`` (chosen from the endpoint).
    :param poll_interval: seconds between polls (default 10).
    :param timeout: seconds to wait in total before a ``timeout`` event; ``None`` waits forever.
    :param carry: JSON-able dict echoed back in the event (default ``None``).
    :param cancel_on_kill: cancel the execution when a user kills the deferred task
        (:meth:`on_kill`; default ``True``). Not on triggerer restarts or timeouts.
    """

    def __init__(
        self,
        execution: str,
        gcp_conn_id: str = "google_cloud_default",
        impersonation_chain: str | Sequence[str] | None = None,
        transport: Literal["rest", "grpc"] | None = None,
        poll_interval: float = 10.0,
        timeout: float | None = None,
        carry: dict[str, Any] | None = None,
        cancel_on_kill: bool = True,
    ) -> None:
        super().__init__()
        self.execution = execution
        self.gcp_conn_id = gcp_conn_id
        self.impersonation_chain = impersonation_chain
        self.transport = transport
        self.poll_interval = poll_interval
        self.timeout = timeout
        self.carry = carry
        self.cancel_on_kill = cancel_on_kill

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """The trigger's dotted class path and exactly its constructor arguments."""
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "execution": self.execution,
                "gcp_conn_id": self.gcp_conn_id,
                "impersonation_chain": self.impersonation_chain,
                "transport": self.transport,
                "poll_interval": self.poll_interval,
                "timeout": self.timeout,
                "carry": self.carry,
                "cancel_on_kill": self.cancel_on_kill,
            },
        )

    def _hook(self) -> CloudRunGpuAsyncHook:
        return CloudRunGpuAsyncHook(
            gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain, transport=self.transport
        )

    def _event(self, status: ExecutionEventStatus, message: str, attempts: list[dict]) -> TriggerEvent:
        return TriggerEvent(
            {
                "status": status.value,
                "execution": self.execution,
                "message": message,
                "attempts": attempts[:MAX_ATTEMPT_RECORDS],
                "carry": self.carry,
            }
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Poll with ``asyncio.sleep`` until the execution finishes or ``timeout`` passes."""
        hook = self._hook()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        attempts: list[dict] = []
        seen: set[tuple[int, int]] = set()
        while True:
            try:
                execution = await hook.get_execution(self.execution)
                tasks = await hook.list_tasks(self.execution)
            except (*TRANSIENT_ERRORS, gexc.RetryError) as exc:
                self.log.warning("Transient error polling %s: %s; retrying", self.execution, exc)
            except gexc.GoogleAPIError as exc:
                yield self._event(ExecutionEventStatus.ERROR, f"{type(exc).__name__}: {exc}", attempts)
                return
            else:
                for record in observe_attempts(tasks, seen):
                    seen.add(record.key)
                    attempts.append(record.to_dict())
                state = execution_state(execution)
                if state is not ExecutionState.RUNNING:
                    message = next((c.message for c in execution.conditions if c.type_ == "Completed"), "")
                    yield self._event(_STATUS_OF[state], message, attempts)
                    return
            if deadline is not None and time.monotonic() >= deadline:
                yield self._event(
                    ExecutionEventStatus.TIMEOUT, f"still running after {self.timeout} s", attempts
                )
                return
            await asyncio.sleep(self.poll_interval)

    async def on_kill(self) -> None:
        """Cancel the execution when a user kills the deferred task (if ``cancel_on_kill``)."""
        if not self.cancel_on_kill:
            return
        self.log.info("Task killed by a user: cancelling execution %s", self.execution)
        try:
            await self._hook().cancel_execution(self.execution)
        except gexc.NotFound:
            self.log.info("Execution %s no longer exists", self.execution)
