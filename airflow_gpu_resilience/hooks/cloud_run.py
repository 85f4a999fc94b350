"""Hook for Cloud Run GPU jobs: every Cloud Run Admin API v2 call the provider makes.

Clients (which endpoint, transport and credentials, ``CLOUD_RUN_EMULATOR_HOST`` included) are
built by :class:`~airflow_gpu_resilience.hooks.cloud_run_clients.CloudRunClientsMixin`.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import requests
from google.api_core import exceptions as gexc
from google.api_core.retry import Retry, if_exception_type
from google.cloud import run_v2
from google.longrunning import operations_pb2

from airflow.providers.google.common.hooks.base_google import PROVIDE_PROJECT_ID, GoogleBaseHook

from airflow_gpu_resilience.exceptions import CloudRunJobNotOursError
from airflow_gpu_resilience.hooks.cloud_run_clients import CloudRunClientsMixin
from airflow_gpu_resilience.job_cleanup import JobCleanupAction, JobCleanupResult, decide_job_cleanup
from airflow_gpu_resilience.job_spec import TASK_TIMEOUT_ENV, GpuJobSpec, template_matches
from airflow_gpu_resilience.labels import is_managed, with_managed_label
from airflow_gpu_resilience.outcome import AttemptLog, ExecutionState, execution_state

if TYPE_CHECKING:
    from google.api_core.operation import Operation

#: Errors worth retrying for idempotent calls (503 UNAVAILABLE, 429 RESOURCE_EXHAUSTED, 504
#: DEADLINE_EXCEEDED or a gateway's 504, a gateway's 502, and a REST connection that broke or
#: timed out). Over REST the client maps by HTTP code, so a 504 arrives as ``GatewayTimeout``
#: (the base class of ``DeadlineExceeded``).
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    gexc.ServiceUnavailable,
    gexc.TooManyRequests,
    gexc.ResourceExhausted,
    gexc.GatewayTimeout,
    gexc.BadGateway,
    requests.ConnectionError,
    requests.Timeout,
)
#: For non-idempotent calls (RunJob) only errors where the request surely was not applied.
REJECTED_ERRORS: tuple[type[Exception], ...] = (gexc.ServiceUnavailable, gexc.TooManyRequests)
#: Errors after which a RunJob may or may not have started an execution.
AMBIGUOUS_ERRORS: tuple[type[Exception], ...] = (
    gexc.GatewayTimeout,  # and its subclass DeadlineExceeded
    gexc.BadGateway,
    gexc.InternalServerError,
    gexc.RetryError,
    requests.ConnectionError,
    requests.Timeout,
)
#: Container env var holding the id of the RunJob request that started an execution.
START_ID_ENV = "AIRFLOW_GPU_RESILIENCE_START_ID"

def default_retry(
    errors: tuple[type[Exception], ...] = TRANSIENT_ERRORS, deadline: float = 120.0, initial: float = 1.0
) -> Retry:
    """Exponential backoff retry (``initial`` s, x2, capped at 20 s, with jitter) on transient errors.

    :param errors: exception types to retry.
    :param deadline: give up after this many seconds in total (default 120), raising
        ``google.api_core.exceptions.RetryError``.
    :param initial: first delay in seconds (default 1).
    :return: a ``google.api_core.retry.Retry``.
    """
    return Retry(
        predicate=if_exception_type(*errors), initial=initial, multiplier=2.0, maximum=20.0, timeout=deadline
    )


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


def error_status(exc: BaseException) -> str | None:
    """The ``google.rpc`` status name of an API error (e.g. ``"FAILED_PRECONDITION"``).

    The REST transport maps errors by HTTP code only (INVALID_ARGUMENT and FAILED_PRECONDITION
    both arrive as ``BadRequest``, whose class-level gRPC code is INVALID_ARGUMENT), so the
    status in the response body (``error.status``) wins; the gRPC code is the fallback.

    :param exc: an exception raised by a Cloud Run client.
    :return: the status name, or ``None`` when it cannot be told.
    """
    response = getattr(exc, "response", None)
    try:
        status = response.json()["error"]["status"]
        if isinstance(status, str) and status:
            return status
    except (AttributeError, TypeError, ValueError, KeyError):
        pass
    code = getattr(exc, "grpc_status_code", None)
    return getattr(code, "name", None)


def execution_env(execution: run_v2.Execution) -> dict[str, str]:
    """The env vars of an execution's first container (the job's, with RunJob overrides applied).

    :param execution: the execution as GetExecution or ListExecutions returns it.
    :return: env var names to values (``value_source`` secrets are left out).
    """
    containers = execution.template.containers
    return {e.name: e.value for e in containers[0].env} if containers else {}


def with_env_overrides(overrides: dict | None, env: dict[str, str]) -> dict:
    """``overrides`` (``RunJobRequest.Overrides`` dict form) with ``env`` added to the first container.

    Pure: the argument is not changed. A name already set there is replaced.

    :param overrides: the user's overrides, or ``None``.
    :param env: env var names to values.
    :return: a new overrides dict.
    """
    result = dict(overrides or {})
    containers = [dict(c) for c in result.get("container_overrides", [])] or [{}]
    kept = [e for e in containers[0].get("env", []) if e.get("name") not in env]
    containers[0]["env"] = kept + [{"name": k, "value": v} for k, v in env.items()]
    result["container_overrides"] = containers
    return result


def override_timeout_seconds(overrides: Mapping[str, Any] | None) -> float | None:
    """The per-execution task timeout of ``RunJobRequest.Overrides`` in dict form, in seconds.

    :param overrides: the overrides (``timeout`` as ``"20s"``, ``{"seconds": 20}`` or a
        ``timedelta``), or ``None``.
    :return: the timeout, or ``None`` when the overrides do not set one.
    """
    if not overrides or overrides.get("timeout") in (None, ""):
        return None
    return run_v2.RunJobRequest.Overrides(timeout=overrides["timeout"]).timeout.total_seconds()


def _full_execution_name(execution: str, job_name: str | None, region: str | None, project_id: str) -> str:
    """``execution`` as a full name; a short id needs ``job_name`` and ``region``.

    :raises ValueError: for a short id without ``job_name`` and ``region``.
    """
    if execution.startswith("projects/"):
        return execution
    if not (job_name and region):
        raise ValueError(f"execution={execution!r} is a short name: pass job_name and region too")
    return f"projects/{project_id}/locations/{region}/jobs/{job_name}/executions/{execution}"


def _as_job(job: run_v2.Job | GpuJobSpec | dict) -> run_v2.Job:
    """A ``run_v2.Job`` from a job, its dict form, or a spec (``GpuJobSpec.to_job()``)."""
    return job.to_job() if isinstance(job, GpuJobSpec) else run_v2.Job(job)


class PollState(str, enum.Enum):
    """What a wait does after one poll (:meth:`ExecutionWatch.step`)."""

    WAIT = "wait"
    """Still running: sleep :attr:`PollStep.sleep_seconds`, then poll again."""
    FINISHED = "finished"
    """The execution has finished."""
    TIMED_OUT = "timed_out"
    """The wait's timeout passed while the execution was still running."""


@dataclass(frozen=True)
class PollStep:
    """The result of one poll: :attr:`state`, and for ``WAIT`` the seconds to sleep (never past the deadline)."""

    state: PollState
    sleep_seconds: float = 0.0


@dataclass
class ExecutionWatch:
    """The pure part of waiting for an execution to finish: one :meth:`step` per poll, no I/O.

    The hook's blocking :meth:`CloudRunGpuHook.wait_for_execution` and the triggers' shared
    watcher (:mod:`~airflow_gpu_resilience.triggers.execution_watcher`, one per watched
    execution, without a timeout) share it: each fetches the execution and its tasks, passes them
    to :meth:`step` (``None`` after a transient API error) and waits as it says. The clock is
    passed in.

    :param poll_interval: seconds between polls (> 0).
    :param timeout: seconds to wait in total, or ``None`` to wait forever.
    :param started: ``time.monotonic()`` when the wait began.
    :param attempts: where the finished attempts seen are recorded (default: a new log).
    """

    poll_interval: float
    timeout: float | None
    started: float
    attempts: AttemptLog = field(default_factory=AttemptLog)

    @property
    def deadline(self) -> float | None:
        """``time.monotonic()`` value when the wait times out, or ``None``."""
        return None if self.timeout is None else self.started + self.timeout

    def step(self, execution: run_v2.Execution | None, tasks: Sequence[run_v2.Task], now: float) -> PollStep:
        """Record the poll's attempts and say what to do next.

        :param execution: the execution as just fetched, or ``None`` if the poll failed transiently.
        :param tasks: its tasks (may be empty when the caller does not track attempts).
        :param now: ``time.monotonic()`` after the poll.
        :return: ``FINISHED`` when the execution is no longer running; else ``TIMED_OUT`` once
            the deadline has passed, else ``WAIT`` with the sleep until the next poll.
        """
        if execution is not None:
            self.attempts.observe(tasks)
            if execution_state(execution) is not ExecutionState.RUNNING:
                return PollStep(PollState.FINISHED)
        deadline = self.deadline
        if deadline is not None and now >= deadline:
            return PollStep(PollState.TIMED_OUT)
        sleep = self.poll_interval if deadline is None else min(self.poll_interval, deadline - now)
        return PollStep(PollState.WAIT, sleep)


class CloudRunGpuHook(CloudRunClientsMixin, GoogleBaseHook):
    """Cloud Run Admin API v2 hook for GPU jobs, executions, tasks and operations.

    Clients are built per location and cached per (kind, location), so calls in different
    regions never share a client pinned to the wrong one.

    :param gcp_conn_id: Airflow connection id (default ``google_cloud_default``).
    :param impersonation_chain: service account (or chain) to impersonate, or ``None``.
    :param transport: ``"rest"`` or ``"grpc"``; default ``None`` picks ``"rest"`` for an
        ``http://`` endpoint and the client default (gRPC) otherwise. Under
        ``CLOUD_RUN_EMULATOR_HOST`` it is always gRPC.
    :param api_endpoint: endpoint override; default ``None`` reads the connection extra
        ``api_endpoint``. Use an explicit scheme (``http://host:port``) for a local server.
        ``CLOUD_RUN_EMULATOR_HOST`` wins over it.
    :param request_timeout: seconds per API request (default 60).
    :param operation_timeout: seconds to wait for a create/update/delete operation (default 600).
    """

    conn_name_attr = "gcp_conn_id"
    default_conn_name = "google_cloud_default"
    conn_type = "google_cloud_platform"
    hook_name = "Google Cloud Run GPU jobs"

    def __init__(
        self,
        gcp_conn_id: str = default_conn_name,
        impersonation_chain: str | Sequence[str] | None = None,
        transport: Literal["rest", "grpc"] | None = None,
        api_endpoint: str | None = None,
        request_timeout: float = 60.0,
        operation_timeout: float = 600.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(gcp_conn_id=gcp_conn_id, impersonation_chain=impersonation_chain, **kwargs)
        self._api_endpoint = api_endpoint
        self._transport = transport
        self.request_timeout = request_timeout
        self.operation_timeout = operation_timeout
        self._clients: dict[tuple[type, str], Any] = {}
        self._emulator_channel = None

    # --- names ---------------------------------------------------------------------------
    @staticmethod
    def job_path(project_id: str, region: str, job_name: str) -> str:
        """``projects/{project_id}/locations/{region}/jobs/{job_name}``."""
        return f"projects/{project_id}/locations/{region}/jobs/{job_name}"

    @staticmethod
    def execution_path(project_id: str, region: str, job_name: str, execution: str) -> str:
        """Full execution name; ``execution`` may already be a full name (returned unchanged)."""
        if execution.startswith("projects/"):
            return execution
        return f"projects/{project_id}/locations/{region}/jobs/{job_name}/executions/{execution}"

    # --- jobs ----------------------------------------------------------------------------
    @GoogleBaseHook.fallback_to_default_project_id
    def create_job(
        self, job_name: str, job: run_v2.Job | GpuJobSpec | dict, region: str, project_id: str = PROVIDE_PROJECT_ID
    ) -> run_v2.Job:
        """Create a job and wait for the operation.

        :param job_name: job id.
        :param job: the job (a ``GpuJobSpec`` is converted with ``to_job()``).
        :param region: Cloud Run region.
        :param project_id: Google Cloud project; default from the connection.
        :return: the created job.
        :raises google.api_core.exceptions.Conflict: (409 ALREADY_EXISTS) if the job exists.
        """
        request = run_v2.CreateJobRequest(
            parent=f"projects/{project_id}/locations/{region}", job_id=job_name, job=_as_job(job)
        )
        operation = self.jobs_client(region).create_job(
            request=request, retry=default_retry(), timeout=self.request_timeout
        )
        return operation.result(timeout=self.operation_timeout)

    @GoogleBaseHook.fallback_to_default_project_id
    def get_job(self, job_name: str, region: str, project_id: str = PROVIDE_PROJECT_ID) -> run_v2.Job:
        """Get a job.

        :param job_name: job id.
        :param region: Cloud Run region.
        :param project_id: Google Cloud project; default from the connection.
        :return: the job.
        :raises google.api_core.exceptions.NotFound: if there is no such job.
        """
        return self.jobs_client(region).get_job(
            name=self.job_path(project_id, region, job_name), retry=default_retry(), timeout=self.request_timeout
        )

    @GoogleBaseHook.fallback_to_default_project_id
    def update_job(
        self, job_name: str, job: run_v2.Job | GpuJobSpec | dict, region: str, project_id: str = PROVIDE_PROJECT_ID
    ) -> run_v2.Job:
        """Replace a job's configuration (UpdateJob has no field mask) and wait for the operation.

        :param job_name: job id.
        :param job: the new job configuration.
        :param region: Cloud Run region.
        :param project_id: Google Cloud project; default from the connection.
        :return: the updated job (its ``generation`` is bumped).
        :raises google.api_core.exceptions.NotFound: if there is no such job.
        """
        desired = _as_job(job)
        desired.name = self.job_path(project_id, region, job_name)
        operation = self.jobs_client(region).update_job(
            request=run_v2.UpdateJobRequest(job=desired), retry=default_retry(), timeout=self.request_timeout
        )
        return operation.result(timeout=self.operation_timeout)

    @GoogleBaseHook.fallback_to_default_project_id
    def delete_job(self, job_name: str, region: str, project_id: str = PROVIDE_PROJECT_ID) -> run_v2.Job | None:
        """Delete a job and wait for the operation; a missing job is not an error.

        :param job_name: job id.
        :param region: Cloud Run region.
        :param project_id: Google Cloud project; default from the connection.
        :return: the deleted job, or ``None`` if it did not exist.
        """
        try:
            operation = self.jobs_client(region).delete_job(
                name=self.job_path(project_id, region, job_name), retry=default_retry(), timeout=self.request_timeout
            )
        except gexc.NotFound:
            self.log.info("Job %s does not exist; nothing to delete", job_name)
            return None
        return operation.result(timeout=self.operation_timeout)

    @GoogleBaseHook.fallback_to_default_project_id
    def unended_executions(self, job_name: str, region: str, project_id: str = PROVIDE_PROJECT_ID) -> list[str]:
        """
        :return: the names of the job's executions that have not ended (no completion time);
            empty when the job does not exist."""
        try:
            executions = self.list_executions(job_name=job_name, region=region, project_id=project_id)
        except gexc.NotFound:
            return []
        return [e.name for e in executions if not e.completion_time]

    def delete_job_when_idle(
        self,
        job_name: str,
        region: str,
        project_id: str = PROVIDE_PROJECT_ID,
        keep_job: bool = False,
        wait_seconds: float = 120.0,
        poll_interval: float = 5.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> JobCleanupResult:
        """A teardown's delete: the job goes only if it is ours and none of its executions runs.

        Follows :func:`~airflow_gpu_resilience.job_cleanup.decide_job_cleanup`: a job without the
        label ``managed-by=airflow-gpu-resilience`` is kept; one with an unended execution (a
        cancelled one still stopping, say) is polled every ``poll_interval`` s for up to
        ``wait_seconds``, then kept with a warning naming the execution. Deleting a job deletes
        its executions' records, so it never races a running one.

        :param job_name: job id.
        :param region: Cloud Run region.
        :param project_id: Google Cloud project; default from the connection.
        :param keep_job: keep the job whatever its state (default ``False``).
        :param wait_seconds: most seconds to wait for unended executions (default 120, >= 0).
        :param poll_interval: seconds between looks at the executions (default 5, > 0).
        :param sleep: how to wait (tests pass a fake); default :func:`time.sleep`.
        :param clock: a monotonic clock in seconds; default :func:`time.monotonic`.
        :return: what was done, as a :class:`~airflow_gpu_resilience.job_cleanup.JobCleanupResult`.
        :raises ValueError: ``wait_seconds`` < 0 or ``poll_interval`` <= 0, before any request.
        """
        if wait_seconds < 0:
            raise ValueError(f"wait_seconds must be >= 0, got {wait_seconds}")
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
        start = clock()
        while True:
            try:
                job = self.get_job(job_name=job_name, region=region, project_id=project_id)
            except gexc.NotFound:
                job = None
            unended: list[str] = []
            if job is not None and is_managed(job.labels) and not keep_job:
                unended = self.unended_executions(job_name=job_name, region=region, project_id=project_id)
            waited = clock() - start
            action = decide_job_cleanup(
                exists=job is not None, ours=job is not None and is_managed(job.labels), keep_job=keep_job,
                unended_executions=unended, waited_seconds=waited, wait_seconds=wait_seconds,
            )
            if action is JobCleanupAction.WAIT:
                self.log.info("Job %s: waiting for %s to end before deleting it (%.0f of %.0f s)",
                              job_name, ", ".join(unended), waited, wait_seconds)
                sleep(poll_interval)
                continue
            if action is JobCleanupAction.DELETE:
                try:
                    self.delete_job(job_name=job_name, region=region, project_id=project_id)
                except (gexc.BadRequest, gexc.FailedPrecondition) as exc:
                    # An execution started between the list and the delete: look again.
                    if error_status(exc) != "FAILED_PRECONDITION":
                        raise
                    self.log.info("Job %s: an execution started before the delete; looking again", job_name)
                    sleep(poll_interval)
                    continue
            elif action is JobCleanupAction.KEEP_RUNNING:
                self.log.warning("Job %s kept: execution %s has not ended after %.0f s; delete the job once it "
                                 "ends", job_name, ", ".join(unended), waited)
            elif action is JobCleanupAction.KEEP_NOT_OURS:
                self.log.warning("Job %s has no label managed-by=airflow-gpu-resilience: not deployed by this "
                                 "provider, left as it is", job_name)
            return JobCleanupResult(job_name=job_name, action=action,
                                    unended_executions=tuple(unended) if action is JobCleanupAction.KEEP_RUNNING
                                    else (), waited_seconds=waited)

    @GoogleBaseHook.fallback_to_default_project_id
    def create_or_update_job(
        self,
        job_name: str,
        job: run_v2.Job | GpuJobSpec | dict,
        region: str,
        project_id: str = PROVIDE_PROJECT_ID,
        adopt_existing_job: bool = False,
    ) -> tuple[run_v2.Job, Literal["created", "updated", "unchanged"]]:
        """Make the deployed job match ``job``; idempotent, and never overwrites a job that is not ours.

        Creates the job if missing; updates it only when its template or labels differ
        (:func:`~airflow_gpu_resilience.job_spec.template_matches`); otherwise changes nothing.
        The job is created and updated with the label ``managed-by=airflow-gpu-resilience``
        (:mod:`airflow_gpu_resilience.labels`) added to ``job``'s labels. An existing job without
        that label (someone else's job of the same name) is not changed, unless
        ``adopt_existing_job``.

        :param job_name: job id.
        :param job: the desired configuration.
        :param region: Cloud Run region.
        :param project_id: Google Cloud project; default from the connection.
        :param adopt_existing_job: update (and label) an existing job that lacks the label
            (default ``False``).
        :return: ``(job, action)`` where action is ``"created"``, ``"updated"`` or ``"unchanged"``.
        :raises CloudRunJobNotOursError: the job exists without the label and
            ``adopt_existing_job`` is false; nothing was changed.
        """
        desired = _as_job(job)
        desired.labels.update(with_managed_label({}))
        try:
            existing = self.get_job(job_name=job_name, region=region, project_id=project_id)
        except gexc.NotFound:
            try:
                return self.create_job(job_name=job_name, job=desired, region=region, project_id=project_id), "created"
            except gexc.Conflict:  # 409 ALREADY_EXISTS: created concurrently, or a retried create went through
                existing = self.get_job(job_name=job_name, region=region, project_id=project_id)
        if not is_managed(existing.labels) and not adopt_existing_job:
            raise CloudRunJobNotOursError(existing.name, dict(existing.labels))
        if template_matches(existing, desired):
            self.log.info("Job %s (generation %s) already matches; not updating", job_name, existing.generation)
            return existing, "unchanged"
        if not is_managed(existing.labels):
            self.log.warning("Job %s has no label managed-by=airflow-gpu-resilience; adopting it "
                             "(adopt_existing_job=True)", job_name)
        return self.update_job(job_name=job_name, job=desired, region=region, project_id=project_id), "updated"

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
        name = _full_execution_name(execution, job_name, region, project_id)
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
        name = _full_execution_name(execution, job_name, region, project_id)
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
        name = _full_execution_name(execution, job_name, region, project_id)
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
        name = _full_execution_name(execution, job_name, region, project_id)
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


def __getattr__(name: str) -> Any:
    """``CloudRunGpuAsyncHook`` moved to :mod:`~airflow_gpu_resilience.hooks.cloud_run_async`; the old
    import path still works (loaded on first use, since that module imports this one)."""
    if name == "CloudRunGpuAsyncHook":
        from airflow_gpu_resilience.hooks.cloud_run_async import CloudRunGpuAsyncHook

        return CloudRunGpuAsyncHook
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
