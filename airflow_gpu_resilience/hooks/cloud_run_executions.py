"""The execution half of :class:`~airflow_gpu_resilience.hooks.cloud_run.CloudRunGpuHook`:
start executions (exactly once, also when RunJob's answer is lost), read them and their tasks,
cancel, delete and wait for them.

A mixin of the hook: its methods use the hook's clients
(:class:`~airflow_gpu_resilience.hooks.cloud_run_clients.CloudRunClientsMixin`),
``request_timeout`` and ``job_path``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from google.api_core import exceptions as gexc
from google.cloud import run_v2
from google.longrunning import operations_pb2

from airflow.providers.google.common.hooks.base_google import PROVIDE_PROJECT_ID, GoogleBaseHook

from airflow_gpu_resilience.attempt_log import AttemptLog
from airflow_gpu_resilience.execution_watch import ExecutionWatch, PollState
from airflow_gpu_resilience.hooks.cloud_run_retry import (
    AMBIGUOUS_ERRORS,
    REJECTED_ERRORS,
    TRANSIENT_ERRORS,
    default_retry,
    error_status,
)
from airflow_gpu_resilience.job_spec import TASK_TIMEOUT_ENV
from airflow_gpu_resilience.overrides import START_ID_ENV, execution_env, override_timeout_seconds, with_env_overrides

if TYPE_CHECKING:
    from google.api_core.operation import Operation

__all__ = ["CloudRunExecutionsMixin", "location_of"]


def location_of(resource_name: str) -> str:
    """The ``{location}`` of a ``projects/{p}/locations/{location}/...`` resource name.

    :param resource_name: a full Cloud Run resource name.
    :return: the location (region).
    :raises ValueError: if the name has no ``locations/`` segment.
    """
    parts = resource_name.split("/")
    if len(parts) < 4 or parts[0] != "projects" or parts[2] != "locations":
        raise ValueError(f"{resource_name!r} is not a projects/{{p}}/locations/{{l}}/... resource name")
    return parts[3]


def full_execution_name(execution: str, job_name: str | None, region: str | None, project_id: str) -> str:
    """``execution`` as a full name; a short id needs ``job_name`` and ``region``.

    :raises ValueError: for a short id without ``job_name`` and ``region``.
    """
    if execution.startswith("projects/"):
        return execution
    if not (job_name and region):
        raise ValueError(f"execution={execution!r} is a short name: pass job_name and region too")
    return f"projects/{project_id}/locations/{region}/jobs/{job_name}/executions/{execution}"


class CloudRunExecutionsMixin:
    """Executions, tasks and operations of :class:`~airflow_gpu_resilience.hooks.cloud_run.CloudRunGpuHook`
    (see the module docs)."""

    @GoogleBaseHook.fallback_to_default_project_id
    def run_job(
        self,
        job_name: str,
        region: str,
        overrides: run_v2.RunJobRequest.Overrides | dict | None = None,
        project_id: str = PROVIDE_PROJECT_ID,
    ) -> tuple[str, str]:
        """Start an execution without waiting for it.

        RunJob is not idempotent, so it is retried only on errors that prove the request was
        rejected (503, 429), never on a deadline.

        :param job_name: job id.
        :param region: Cloud Run region.
        :param overrides: ``RunJobRequest.Overrides`` (or its dict form): container args/env,
            ``task_count``, ``timeout``.
        :param project_id: Google Cloud project; default from the connection.
        :return: ``(operation name, execution name)``, both full resource names.
        """
        request = run_v2.RunJobRequest(name=self.job_path(project_id, region, job_name))
        if overrides:
            request.overrides = overrides
        operation: Operation = self.jobs_client(region).run_job(
            request=request, retry=default_retry(REJECTED_ERRORS), timeout=self.request_timeout
        )
        execution = operation.metadata
        return operation.operation.name, execution.name

    @GoogleBaseHook.fallback_to_default_project_id
    def start_execution(
        self,
        job_name: str,
        region: str,
        overrides: dict | None = None,
        project_id: str = PROVIDE_PROJECT_ID,
        attempts: int = 5,
        backoff: float = 2.0,
    ) -> str:
        """Start exactly one execution, also when RunJob's answer is lost.

        The request carries a fresh id in the container env var ``AIRFLOW_GPU_RESILIENCE_START_ID``,
        and, with a ``timeout`` override, ``TASK_TIMEOUT_SECONDS`` set to it (the worker checkpoints
        and exits 143 before that execution's own task timeout).
        After an ambiguous error (:data:`AMBIGUOUS_ERRORS`: 500, 502, 504 or a deadline, retries
        exhausted, a broken connection) the job's executions are searched for that id: a found execution is
        returned, otherwise RunJob is sent again, up to ``attempts`` times.

        :param job_name: job id.
        :param region: Cloud Run region.
        :param overrides: ``RunJobRequest.Overrides`` in dict form, or ``None``.
        :param project_id: Google Cloud project; default from the connection.
        :param attempts: RunJob requests at most (default 5).
        :param backoff: seconds before the second request, doubled after each (default 2).
        :return: the full name of the execution.
        :raises google.api_core.exceptions.GoogleAPIError: the last error, after ``attempts``
            requests without an execution, or a non-retryable error (e.g. 404 NotFound).
        """
        start_id = uuid.uuid4().hex
        env = {START_ID_ENV: start_id}
        timeout = override_timeout_seconds(overrides)
        if timeout is not None:  # the worker's deadline follows the execution's own task timeout
            env[TASK_TIMEOUT_ENV] = str(int(timeout)) if float(timeout).is_integer() else repr(timeout)
        request_overrides = with_env_overrides(overrides, env)
        for attempt in range(1, attempts + 1):
            try:
                return self.run_job(
                    job_name=job_name, region=region, overrides=request_overrides, project_id=project_id
                )[1]
            except AMBIGUOUS_ERRORS as exc:
                self.log.warning("RunJob for %s failed (%s); looking for its execution", job_name, exc)
                found = self.find_executions(
                    job_name=job_name, region=region, env={START_ID_ENV: start_id}, project_id=project_id
                )
                if found:
                    return found[0].name
                if attempt == attempts:
                    raise
            time.sleep(backoff * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    @GoogleBaseHook.fallback_to_default_project_id
    def find_executions(
        self, job_name: str, region: str, env: dict[str, str], project_id: str = PROVIDE_PROJECT_ID
    ) -> list[run_v2.Execution]:
        """The job's executions whose first container has every env var in ``env``, newest first.

        :param job_name: job id.
        :param region: Cloud Run region.
        :param env: env var names to required values.
        :param project_id: Google Cloud project; default from the connection.
        :return: the matching executions.
        """
        executions = self.list_executions(job_name=job_name, region=region, project_id=project_id)
        return [e for e in executions if env.items() <= execution_env(e).items()]

    # --- executions and tasks ------------------------------------------------------------
    @GoogleBaseHook.fallback_to_default_project_id
    def get_execution(
        self,
        execution: str,
        job_name: str | None = None,
        region: str | None = None,
        project_id: str = PROVIDE_PROJECT_ID,
    ) -> run_v2.Execution:
        """Get an execution.

        :param execution: full execution name, or its short id together with job_name and region.
        :param job_name: job id (only for a short ``execution``).
        :param region: Cloud Run region (only for a short ``execution``).
        :param project_id: Google Cloud project; default from the connection.
        :return: the execution.
        :raises google.api_core.exceptions.NotFound: if there is no such execution.
        """
        name = full_execution_name(execution, job_name, region, project_id)
        return self.executions_client(location_of(name)).get_execution(
            name=name, retry=default_retry(), timeout=self.request_timeout
        )

    @GoogleBaseHook.fallback_to_default_project_id
    def list_executions(
        self, job_name: str, region: str, project_id: str = PROVIDE_PROJECT_ID
    ) -> list[run_v2.Execution]:
        """List a job's executions, newest first (all pages).

        :param job_name: job id (``-`` for every job in the region).
        :param region: Cloud Run region.
        :param project_id: Google Cloud project; default from the connection.
        :return: the executions.
        """
        pager = self.executions_client(region).list_executions(
            parent=self.job_path(project_id, region, job_name), retry=default_retry(), timeout=self.request_timeout
        )
        return list(pager)

    @GoogleBaseHook.fallback_to_default_project_id
    def list_tasks(
        self,
        execution: str,
        job_name: str | None = None,
        region: str | None = None,
        project_id: str = PROVIDE_PROJECT_ID,
    ) -> list[run_v2.Task]:
        """List an execution's tasks, sorted by index (all pages).

        :param execution: full execution name, or its short id together with job_name and region.
        :param job_name: job id (only for a short ``execution``).
        :param region: Cloud Run region (only for a short ``execution``).
        :param project_id: Google Cloud project; default from the connection.
        :return: the tasks.
        """
        name = full_execution_name(execution, job_name, region, project_id)
        pager = self.tasks_client(location_of(name)).list_tasks(
            parent=name, retry=default_retry(), timeout=self.request_timeout
        )
        return sorted(pager, key=lambda task: task.index)

    @GoogleBaseHook.fallback_to_default_project_id
    def cancel_execution(
        self,
        execution: str,
        job_name: str | None = None,
        region: str | None = None,
        project_id: str = PROVIDE_PROJECT_ID,
        wait: bool = False,
    ) -> run_v2.Execution:
        """Cancel an execution (SIGTERM, grace period, SIGKILL to its running tasks).

        :param execution: full execution name, or its short id together with job_name and region.
        :param job_name: job id (only for a short ``execution``).
        :param region: Cloud Run region (only for a short ``execution``).
        :param project_id: Google Cloud project; default from the connection.
        :param wait: wait for the cancellation to finish (default ``False``).
        :return: the execution (final when ``wait``, else as the operation's metadata shows it);
            an execution that has already finished (FAILED_PRECONDITION) is returned unchanged.
        :raises google.api_core.exceptions.NotFound: if there is no such execution.
        """
        name = full_execution_name(execution, job_name, region, project_id)
        try:
            operation = self.executions_client(location_of(name)).cancel_execution(
                name=name, retry=default_retry(), timeout=self.request_timeout
            )
        except (gexc.BadRequest, gexc.FailedPrecondition) as exc:
            if error_status(exc) != "FAILED_PRECONDITION":
                raise
            self.log.info("Execution %s has already finished; nothing to cancel", name)
            return self.get_execution(execution=name)
        return operation.result(timeout=self.operation_timeout) if wait else operation.metadata

    @GoogleBaseHook.fallback_to_default_project_id
    def delete_execution(
        self,
        execution: str,
        job_name: str | None = None,
        region: str | None = None,
        project_id: str = PROVIDE_PROJECT_ID,
    ) -> run_v2.Execution:
        """Delete a finished execution and wait for the operation.

        :param execution: full execution name, or its short id together with job_name and region.
        :param job_name: job id (only for a short ``execution``).
        :param region: Cloud Run region (only for a short ``execution``).
        :param project_id: Google Cloud project; default from the connection.
        :return: the deleted execution.
        :raises google.api_core.exceptions.BadRequest: (FAILED_PRECONDITION, see
            :func:`error_status`) if the execution is still running.
        :raises google.api_core.exceptions.NotFound: if there is no such execution.
        """
        name = full_execution_name(execution, job_name, region, project_id)
        operation = self.executions_client(location_of(name)).delete_execution(
            name=name, retry=default_retry(), timeout=self.request_timeout
        )
        return operation.result(timeout=self.operation_timeout)

    def get_operation(self, operation_name: str) -> operations_pb2.Operation:
        """Get a long-running operation by its full name.

        :param operation_name: ``projects/{p}/locations/{l}/operations/{id}``.
        :return: the raw ``google.longrunning`` operation.
        """
        return self.jobs_client(location_of(operation_name)).get_operation(
            request={"name": operation_name}, retry=default_retry(), timeout=self.request_timeout
        )

    def wait_for_execution(
        self,
        execution: str,
        poll_interval: float = 10.0,
        timeout: float | None = None,
        on_poll: Callable[[run_v2.Execution, list[run_v2.Task]], None] | None = None,
        attempts: AttemptLog | None = None,
    ) -> run_v2.Execution:
        """Poll an execution (and its tasks) until it is finished; blocking.

        :param execution: full execution name.
        :param poll_interval: seconds between polls (default 10).
        :param timeout: give up after this many seconds (default ``None``: wait forever).
        :param on_poll: called with the execution and its tasks after every successful poll.
        :param attempts: when given, every finished task attempt seen is recorded in it.
        :return: the finished execution.
        :raises TimeoutError: if ``timeout`` passes first. Transient API errors (also after the
            per-call retries gave up) never end the wait: the next poll tries again.
        """
        watch = ExecutionWatch(poll_interval, timeout, time.monotonic(),
                               attempts if attempts is not None else AttemptLog())
        with_tasks = on_poll is not None or attempts is not None
        while True:
            current, tasks = None, []
            try:
                fetched = self.get_execution(execution=execution)
                tasks = self.list_tasks(execution=execution) if with_tasks else []
                current = fetched
            except (*TRANSIENT_ERRORS, gexc.RetryError) as exc:
                self.log.warning("Transient error polling %s: %s; polling again", execution, exc)
            step = watch.step(current, tasks, time.monotonic())
            if current is not None and on_poll is not None:
                on_poll(current, tasks)
            if step.state is PollState.FINISHED:
                return current
            if step.state is PollState.TIMED_OUT:
                raise TimeoutError(f"execution {execution} still running after {timeout} s")
            time.sleep(step.sleep_seconds)
