"""REST handlers: parse the request, make one backend call, serialize the result.

Each handler takes a :class:`Request` and returns a protobuf or proto-plus message (or a list
response); the route table in :mod:`.urls` names these functions, and :mod:`.app` turns their
result into JSON (camelCase, integer enums when ``$alt`` asks).
"""

from __future__ import annotations

import dataclasses

from google.cloud import run_v2
from google.longrunning import operations_pb2
from google.protobuf import empty_pb2, json_format

from .backend import Registry
from .exceptions import InvalidArgument


@dataclasses.dataclass
class Request:
    """One parsed API request.

    :param registry: the emulator's backends.
    :param params: path parameters (``name`` or ``parent``).
    :param query: query parameters (first value of each).
    :param body: the raw JSON body (``b""`` when absent).
    """

    registry: Registry
    params: dict
    query: dict
    body: bytes

    @property
    def path_name(self) -> str:
        return self.params.get("name") or self.params["parent"]

    @property
    def backend(self):
        return self.registry.for_name(self.path_name, "name" if "name" in self.params else "parent")

    def flag(self, key: str) -> bool:
        return str(self.query.get(key, "")).lower() in ("1", "true")

    def int(self, key: str) -> int:
        try:
            return int(self.query.get(key) or 0)
        except ValueError:
            raise InvalidArgument(f"{key}: not an integer.") from None

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


def create_job(req: Request):
    job = req.message(run_v2.Job)
    return req.backend.create_job(req.query.get("jobId", ""), job, req.flag("validateOnly")).to_pb()


def get_job(req: Request):
    return req.backend.get_job(req.path_name).to_proto()


def list_jobs(req: Request):
    jobs, token = req.backend.list_jobs(req.int("pageSize"), req.query.get("pageToken", ""))
    return run_v2.ListJobsResponse(jobs=[j.to_proto() for j in jobs], next_page_token=token)


def update_job(req: Request):
    job = req.message(run_v2.Job)
    job.name = req.path_name
    op = req.backend.update_job(job, req.flag("allowMissing"), req.flag("validateOnly"))
    return op.to_pb()


def delete_job(req: Request):
    return req.backend.delete_job(req.path_name, req.query.get("etag", ""), req.flag("validateOnly")).to_pb()


def run_job(req: Request):
    body = req.message(run_v2.RunJobRequest)
    overrides = body.overrides if "overrides" in body else None
    return req.backend.run_job(req.path_name, body.etag, overrides, body.validate_only).to_pb()


def list_executions(req: Request):
    items, token = req.backend.list_executions(req.path_name, req.int("pageSize"), req.query.get("pageToken", ""))
    return run_v2.ListExecutionsResponse(executions=[e.to_proto() for e in items], next_page_token=token)


def get_execution(req: Request):
    return req.backend.get_execution(req.path_name).to_proto()


def delete_execution(req: Request):
    op = req.backend.delete_execution(req.path_name, req.query.get("etag", ""), req.flag("validateOnly"))
    return op.to_pb()


def cancel_execution(req: Request):
    body = req.message(run_v2.CancelExecutionRequest)
    return req.backend.cancel_execution(req.path_name, body.etag, body.validate_only).to_pb()


def list_tasks(req: Request):
    items, token = req.backend.list_tasks(req.path_name, req.int("pageSize"), req.query.get("pageToken", ""))
    return run_v2.ListTasksResponse(tasks=[t.to_proto() for t in items], next_page_token=token)


def get_task(req: Request):
    return req.backend.get_task(req.path_name).to_proto()


def list_operations(req: Request):
    ops, token = req.backend.list_operations(req.int("pageSize"), req.query.get("pageToken", ""))
    return operations_pb2.ListOperationsResponse(operations=[o.to_pb() for o in ops], next_page_token=token)


def get_operation(req: Request):
    return req.backend.get_operation(req.path_name).to_pb()


def wait_operation(req: Request):
    body = req.pb(operations_pb2.WaitOperationRequest)
    timeout = body.timeout.ToTimedelta().total_seconds() if body.HasField("timeout") else 60.0
    return req.backend.wait_operation(req.path_name, timeout).to_pb()


def delete_operation(req: Request):
    req.backend.delete_operation(req.path_name)
    return empty_pb2.Empty()
