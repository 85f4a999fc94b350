"""Hook for Cloud Run GPU jobs: every Cloud Run Admin API v2 call the provider makes.

Jobs are here; executions, tasks and operations in
:class:`~airflow_gpu_resilience.hooks.cloud_run_executions.CloudRunExecutionsMixin`; clients
(which endpoint, transport and credentials, ``CLOUD_RUN_EMULATOR_HOST`` included) are built by
:class:`~airflow_gpu_resilience.hooks.cloud_run_clients.CloudRunClientsMixin`; the retry policy is
:mod:`~airflow_gpu_resilience.hooks.cloud_run_retry`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from google.api_core import exceptions as gexc
from google.cloud import run_v2

from airflow.providers.google.common.hooks.base_google import PROVIDE_PROJECT_ID, GoogleBaseHook

from airflow_gpu_resilience.exceptions import CloudRunJobNotOursError
from airflow_gpu_resilience.hooks.cloud_run_clients import CloudRunClientsMixin
from airflow_gpu_resilience.hooks.cloud_run_executions import CloudRunExecutionsMixin
from airflow_gpu_resilience.hooks.cloud_run_retry import default_retry, error_status
from airflow_gpu_resilience.job_cleanup import JobCleanupAction, JobCleanupResult, decide_job_cleanup
from airflow_gpu_resilience.job_spec import GpuJobSpec, template_matches
from airflow_gpu_resilience.labels import is_managed, with_managed_label

def _as_job(job: run_v2.Job | GpuJobSpec | dict) -> run_v2.Job:
    """A ``run_v2.Job`` from a job, its dict form, or a spec (``GpuJobSpec.to_job()``)."""
    return job.to_job() if isinstance(job, GpuJobSpec) else run_v2.Job(job)


class CloudRunGpuHook(CloudRunExecutionsMixin, CloudRunClientsMixin, GoogleBaseHook):
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

def __getattr__(name: str) -> Any:
    """``CloudRunGpuAsyncHook`` moved to :mod:`~airflow_gpu_resilience.hooks.cloud_run_async`; the old
    import path still works (loaded on first use, since that module imports this one)."""
    if name == "CloudRunGpuAsyncHook":
        from airflow_gpu_resilience.hooks.cloud_run_async import CloudRunGpuAsyncHook

        return CloudRunGpuAsyncHook
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
