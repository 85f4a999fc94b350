"""REST transcoding: each function turns one HTTP request into its RPC's request message.

Each takes a :class:`Request` (path parameters, query, JSON body) and returns the request
message of the method that :mod:`.urls` pairs it with, filled as Google's HTTP rules for the
Cloud Run Admin API v2 map it; :func:`~.rpcs.call` then runs that method exactly as the gRPC
server does, and :mod:`.app` renders the result as JSON (camelCase, integer enums when ``$alt``
asks).
"""

from __future__ import annotations

import dataclasses

from google.cloud import run_v2
from google.longrunning import operations_pb2
from google.protobuf import json_format

from .exceptions import InvalidArgument


@dataclasses.dataclass
class Request:
    """One parsed API request.

    :param params: path parameters (``name`` or ``parent``).
    :param query: query parameters (first value of each).
    :param body: the raw JSON body (``b""`` when absent).
    """

    params: dict
    query: dict
    body: bytes

    @property
    def name(self) -> str:
        return self.params["name"]

    @property
    def parent(self) -> str:
        return self.params["parent"]

    def flag(self, key: str) -> bool:
        return str(self.query.get(key, "")).lower() in ("1", "true")

    def int(self, key: str) -> int:
        """A query parameter as an int32 (0 when absent), as the request fields are."""
        try:
            value = int(self.query.get(key) or 0)
        except ValueError:
            raise InvalidArgument(f"{key}: not an integer.") from None
        if not -(2**31) <= value < 2**31:
            raise InvalidArgument(f"{key}: {value} is out of the range of a 32-bit integer.")
        return value

    def message(self, cls):
        """The body parsed into proto-plus ``cls`` (unknown fields are an error, as in Google)."""
        try:
            return cls.from_json(self.body or b"{}")
        except (json_format.ParseError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"Invalid JSON payload: {exc}") from None
        except RecursionError:
            raise InvalidArgument("Invalid JSON payload: nested too deeply.") from None

    def pb(self, pb_cls):
        """The body parsed into a plain protobuf message."""
        try:
            return json_format.Parse(self.body or b"{}", pb_cls())
        except (json_format.ParseError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"Invalid JSON payload: {exc}") from None
        except RecursionError:
            raise InvalidArgument("Invalid JSON payload: nested too deeply.") from None


def create_job(req: Request) -> run_v2.CreateJobRequest:
    return run_v2.CreateJobRequest(parent=req.parent, job=req.message(run_v2.Job), job_id=req.query.get("jobId", ""),
                                   validate_only=req.flag("validateOnly"))


def get_job(req: Request) -> run_v2.GetJobRequest:
    return run_v2.GetJobRequest(name=req.name)


def list_jobs(req: Request) -> run_v2.ListJobsRequest:
    return run_v2.ListJobsRequest(parent=req.parent, page_size=req.int("pageSize"),
                                  page_token=req.query.get("pageToken", ""))


def update_job(req: Request) -> run_v2.UpdateJobRequest:
    job = req.message(run_v2.Job)
    job.name = req.name  # the path is /v2/{job.name}
    return run_v2.UpdateJobRequest(job=job, allow_missing=req.flag("allowMissing"),
                                   validate_only=req.flag("validateOnly"))


def delete_job(req: Request) -> run_v2.DeleteJobRequest:
    return run_v2.DeleteJobRequest(name=req.name, etag=req.query.get("etag", ""), validate_only=req.flag("validateOnly"))


def run_job(req: Request) -> run_v2.RunJobRequest:
    request = req.message(run_v2.RunJobRequest)  # the body is the whole request ("*")
    request.name = req.name
    return request


def list_executions(req: Request) -> run_v2.ListExecutionsRequest:
    return run_v2.ListExecutionsRequest(parent=req.parent, page_size=req.int("pageSize"),
                                        page_token=req.query.get("pageToken", ""))


def get_execution(req: Request) -> run_v2.GetExecutionRequest:
    return run_v2.GetExecutionRequest(name=req.name)


def delete_execution(req: Request) -> run_v2.DeleteExecutionRequest:
    return run_v2.DeleteExecutionRequest(name=req.name, etag=req.query.get("etag", ""),
                                         validate_only=req.flag("validateOnly"))


def cancel_execution(req: Request) -> run_v2.CancelExecutionRequest:
    request = req.message(run_v2.CancelExecutionRequest)  # the body is the whole request ("*")
    request.name = req.name
    return request


def list_tasks(req: Request) -> run_v2.ListTasksRequest:
    return run_v2.ListTasksRequest(parent=req.parent, page_size=req.int("pageSize"),
                                   page_token=req.query.get("pageToken", ""))


def get_task(req: Request) -> run_v2.GetTaskRequest:
    return run_v2.GetTaskRequest(name=req.name)


def list_operations(req: Request) -> operations_pb2.ListOperationsRequest:
    return operations_pb2.ListOperationsRequest(name=req.name, filter=req.query.get("filter", ""),
                                                page_size=req.int("pageSize"), page_token=req.query.get("pageToken", ""))


def get_operation(req: Request) -> operations_pb2.GetOperationRequest:
    return operations_pb2.GetOperationRequest(name=req.name)


def wait_operation(req: Request) -> operations_pb2.WaitOperationRequest:
    request = req.pb(operations_pb2.WaitOperationRequest)  # the body is the whole request ("*")
    request.name = req.name
    return request


def delete_operation(req: Request) -> operations_pb2.DeleteOperationRequest:
    return operations_pb2.DeleteOperationRequest(name=req.name)
