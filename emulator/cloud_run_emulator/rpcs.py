"""The API methods, once for both transports: one function per RPC from its request message to
its response message, and :func:`call`, which runs one with the injected faults and the lock.

The REST app (:mod:`.app`, :mod:`.responses`, :mod:`.urls`) turns an HTTP request into the RPC's
request message, as Google's HTTP rules map it (path variables, query parameters, the body); the
gRPC server (:mod:`.grpc_server`) receives that message as it is. Both then go through
:func:`call`, so the request quota and counters (:mod:`.quota`), validation, faults and errors
are the same on both (the backend raises the :mod:`.exceptions` types; each transport renders
them once: JSON on REST, a status code on gRPC).

Methods (:data:`RPCS`, keyed by the gRPC method path ``/{service}/{method}``): Jobs
(CreateJob, GetJob, ListJobs, UpdateJob, DeleteJob, RunJob), Executions (GetExecution,
ListExecutions, DeleteExecution, CancelExecution), Tasks (GetTask, ListTasks), and
``google.longrunning.Operations`` (GetOperation, ListOperations, WaitOperation,
DeleteOperation). The IAM methods and CancelOperation are not served (UNIMPLEMENTED). The
table marks the methods that change state (``mutating``): the writes of the request quota.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Optional

from google.cloud import run_v2
from google.longrunning import operations_pb2
from google.protobuf import empty_pb2

from .backend import CloudRunBackend, Registry
from .exceptions import EmulatorError
from .faults import ApiFaults
from .quota import RequestQuota

logger = logging.getLogger(__name__)

JOBS = "google.cloud.run.v2.Jobs"
EXECUTIONS = "google.cloud.run.v2.Executions"
TASKS = "google.cloud.run.v2.Tasks"
OPERATIONS = "google.longrunning.Operations"
#: WaitOperation's wait when the request sets no timeout (s).
DEFAULT_WAIT_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class Rpc:
    """One API method.

    :param service: the gRPC service, e.g. ``google.cloud.run.v2.Jobs``.
    :param method: the method, e.g. ``CreateJob``.
    :param request: its request message class: proto-plus for Cloud Run (``run_v2.CreateJobRequest``),
        plain protobuf for ``google.longrunning``.
    :param handler: ``handler(backend, request) -> message``: one call of the backend of the
        request's project and location (the :class:`~.backend.CloudRunBackend` of :attr:`resource`).
    :param mutating: whether it changes state: a write of the request quota (see :mod:`.quota`),
        and the only kind a lost-answer fault applies to.
    :param resource: the request field holding the resource or parent name the request is about
        (``name``, ``parent`` or ``job.name``): its project and location pick the backend, and the
        quota charges them.
    :param locate: ``locate(request) -> name``, for a method whose request names its resource
        otherwise than by one field (Cloud Build's GetBuild: a project and a build id); it
        replaces :attr:`resource` (``None``, the default: the field is read).
    """

    service: str
    method: str
    request: type
    handler: Callable
    mutating: bool = False
    resource: str = "name"
    locate: Optional[Callable] = None

    @property
    def path(self) -> str:
        """The gRPC method path, ``/google.cloud.run.v2.Jobs/CreateJob``."""
        return f"/{self.service}/{self.method}"

    def resource_name(self, request) -> str:
        """The resource or parent name in ``request`` (a message of :attr:`request`)."""
        if self.locate is not None:
            return self.locate(request)
        value = request
        for field in self.resource.split("."):
            value = getattr(value, field)
        return value


def create_job(backend: CloudRunBackend, r: run_v2.CreateJobRequest) -> operations_pb2.Operation:
    return backend.create_job(r.job_id, r.job, r.validate_only).to_pb()


def get_job(backend: CloudRunBackend, r: run_v2.GetJobRequest) -> run_v2.Job:
    return backend.get_job(r.name).to_proto()


def list_jobs(backend: CloudRunBackend, r: run_v2.ListJobsRequest) -> run_v2.ListJobsResponse:
    jobs, token = backend.list_jobs(r.page_size, r.page_token)
    return run_v2.ListJobsResponse(jobs=[j.to_proto() for j in jobs], next_page_token=token)


def update_job(backend: CloudRunBackend, r: run_v2.UpdateJobRequest) -> operations_pb2.Operation:
    return backend.update_job(r.job, r.allow_missing, r.validate_only).to_pb()


def delete_job(backend: CloudRunBackend, r: run_v2.DeleteJobRequest) -> operations_pb2.Operation:
    return backend.delete_job(r.name, r.etag, r.validate_only).to_pb()


def run_job(backend: CloudRunBackend, r: run_v2.RunJobRequest) -> operations_pb2.Operation:
    overrides = r.overrides if "overrides" in r else None
    return backend.run_job(r.name, r.etag, overrides, r.validate_only).to_pb()


def list_executions(backend: CloudRunBackend,
                    r: run_v2.ListExecutionsRequest) -> run_v2.ListExecutionsResponse:
    items, token = backend.list_executions(r.parent, r.page_size, r.page_token)
    return run_v2.ListExecutionsResponse(executions=[e.to_proto() for e in items], next_page_token=token)


def get_execution(backend: CloudRunBackend, r: run_v2.GetExecutionRequest) -> run_v2.Execution:
    return backend.get_execution(r.name).to_proto()


def delete_execution(backend: CloudRunBackend, r: run_v2.DeleteExecutionRequest) -> operations_pb2.Operation:
    return backend.delete_execution(r.name, r.etag, r.validate_only).to_pb()


def cancel_execution(backend: CloudRunBackend, r: run_v2.CancelExecutionRequest) -> operations_pb2.Operation:
    return backend.cancel_execution(r.name, r.etag, r.validate_only).to_pb()


def list_tasks(backend: CloudRunBackend, r: run_v2.ListTasksRequest) -> run_v2.ListTasksResponse:
    items, token = backend.list_tasks(r.parent, r.page_size, r.page_token)
    return run_v2.ListTasksResponse(tasks=[t.to_proto() for t in items], next_page_token=token)


def get_task(backend: CloudRunBackend, r: run_v2.GetTaskRequest) -> run_v2.Task:
    return backend.get_task(r.name).to_proto()


def list_operations(backend: CloudRunBackend,
                    r: operations_pb2.ListOperationsRequest) -> operations_pb2.ListOperationsResponse:
    ops, token = backend.list_operations(r.page_size, r.page_token)
    return operations_pb2.ListOperationsResponse(operations=[o.to_pb() for o in ops], next_page_token=token)


def get_operation(backend: CloudRunBackend, r: operations_pb2.GetOperationRequest) -> operations_pb2.Operation:
    return backend.get_operation(r.name).to_pb()


def wait_operation(backend: CloudRunBackend, r: operations_pb2.WaitOperationRequest) -> operations_pb2.Operation:
    timeout = r.timeout.ToTimedelta().total_seconds() if r.HasField("timeout") else DEFAULT_WAIT_SECONDS
    return backend.wait_operation(r.name, timeout).to_pb()


def delete_operation(backend: CloudRunBackend, r: operations_pb2.DeleteOperationRequest) -> empty_pb2.Empty:
    backend.delete_operation(r.name)
    return empty_pb2.Empty()


_ops = operations_pb2
#: Every served method, by its gRPC method path.
RPCS = {rpc.path: rpc for rpc in (
    Rpc(JOBS, "CreateJob", run_v2.CreateJobRequest, create_job, mutating=True, resource="parent"),
    Rpc(JOBS, "GetJob", run_v2.GetJobRequest, get_job),
    Rpc(JOBS, "ListJobs", run_v2.ListJobsRequest, list_jobs, resource="parent"),
    Rpc(JOBS, "UpdateJob", run_v2.UpdateJobRequest, update_job, mutating=True, resource="job.name"),
    Rpc(JOBS, "DeleteJob", run_v2.DeleteJobRequest, delete_job, mutating=True),
    Rpc(JOBS, "RunJob", run_v2.RunJobRequest, run_job, mutating=True),
    Rpc(EXECUTIONS, "GetExecution", run_v2.GetExecutionRequest, get_execution),
    Rpc(EXECUTIONS, "ListExecutions", run_v2.ListExecutionsRequest, list_executions, resource="parent"),
    Rpc(EXECUTIONS, "DeleteExecution", run_v2.DeleteExecutionRequest, delete_execution, mutating=True),
    Rpc(EXECUTIONS, "CancelExecution", run_v2.CancelExecutionRequest, cancel_execution, mutating=True),
    Rpc(TASKS, "GetTask", run_v2.GetTaskRequest, get_task),
    Rpc(TASKS, "ListTasks", run_v2.ListTasksRequest, list_tasks, resource="parent"),
    Rpc(OPERATIONS, "GetOperation", _ops.GetOperationRequest, get_operation),
    Rpc(OPERATIONS, "ListOperations", _ops.ListOperationsRequest, list_operations),
    Rpc(OPERATIONS, "WaitOperation", _ops.WaitOperationRequest, wait_operation),
    Rpc(OPERATIONS, "DeleteOperation", _ops.DeleteOperationRequest, delete_operation, mutating=True),
)}


def call(registry: Registry, faults: ApiFaults, quota: RequestQuota, rpc: Rpc, request, render: Callable):
    """Run one API method as both transports do: counted and charged to its request quota
    first (as Google's frontend does, before the service), then an injected delay or error, then
    the handler and ``render`` under the registry's lock (a response never mixes two states;
    WaitOperation releases the lock while it waits), then a lost-answer fault.

    :param registry: the emulator's backends.
    :param faults: the API fault injector (see :mod:`.faults`).
    :param quota: the request quota and counters (see :mod:`.quota`).
    :param rpc: the method.
    :param request: its request message (of ``rpc.request``).
    :param render: ``render(message) -> answer``: the transport's serialization.
    :return: what ``render`` returned.
    :raises EmulatorError: the method's error, an injected one, or the quota's 429
        (:class:`~.exceptions.ResourceExhausted`).
    """
    name = rpc.resource_name(request)
    quota.admit(rpc.method, rpc.mutating, name)
    delay, fault = faults.next_fault()
    if delay:
        time.sleep(delay)
    if fault:
        raise fault
    with registry.cond:
        answer = render(rpc.handler(registry.for_name(name, rpc.resource), request))
    lost = faults.lost_answer(rpc.mutating)  # applied, but the client never hears so
    if lost:
        raise lost
    return answer


def internal_error(exc: Exception) -> EmulatorError:
    """Log an unexpected exception (an emulator bug) and wrap it as INTERNAL.

    :param exc: the exception.
    :return: the error both transports answer with.
    """
    logger.exception("internal error")
    return EmulatorError(f"Internal emulator error: {type(exc).__name__}: {exc}")
