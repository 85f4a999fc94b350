"""The FastAPI application: one catch-all ``/v2`` dispatcher over :mod:`urls` plus the admin
namespace ``/_emulator``.

Admin endpoints:

- ``GET /_emulator/health`` -> ``{"status": "ok", "gcsEndpoint", "loggingRequests", "taskProcesses"}``
  (``loggingRequests``: Cloud Logging ``entries:list`` requests served so far; ``taskProcesses``:
  ``{"limit", "running", "peak"}``, the task processes running now and at most at once, over
  all executions, under ``serve --max-task-processes``).
- ``POST /_emulator/reset`` -> stop the preemption schedule and all executions and forget all
  resources (Cloud Run's, Cloud Build's builds, Artifact Registry's repositories and the images
  pushed there), the request quota's windows and the request counters; body ``{"gcs": true}``
  also wipes the GCS emulator.
- ``GET /_emulator/quota`` -> ``{"readRequestsPerMinute", "writeRequestsPerMinute",
  "windowSeconds", "usage": {"projects/P/locations/R": {"read", "write"}}}``: the Admin API
  request quota per project and region (0: off) and the requests admitted in the window now;
  ``POST`` with any of the three settings changes them and answers the same (see :mod:`.quota`).
- ``GET /_emulator/requests[?project=P&region=R]`` -> ``{"total", "methods": {METHOD: {...}},
  "locations": {"projects/P/locations/R": {METHOD: {...}}}}``, each ``{"requests",
  "quotaExceeded"}``: the API requests per method (REST and gRPC together) and how many got the
  quota's 429; ``DELETE`` answers the same for all and zeroes the counters.
- ``POST /_emulator/preempt`` with ``{"execution": NAME, "taskIndex": 0, "graceSeconds": 10,
  "waitSeconds": 10}`` or ``{"task": TASK_NAME, ...}`` -> ``{"task", "attempt", "pid"}``.
- ``POST /_emulator/faults`` -> see :mod:`faults`.
- ``POST /_emulator/preemptions/schedule`` with ``{"meanSeconds", "seed", "graceSeconds",
  "namePrefix", "maxPreemptions"}`` starts (replaces) a seeded preemption schedule; ``GET``
  reports it and its preemptions, ``DELETE`` stops it (see :class:`~.faults.PreemptionSchedule`).
- ``POST /_emulator/transitions`` with any of ``{"taskStartDelaySeconds",
  "preemptionConsumesRetry", "graceSeconds", "gpuQuota", "maxTaskProcesses"}`` -> the current values (runtime pacing; takes
  effect for attempts started or stopped afterwards; ``graceSeconds`` is the default grace of
  preemption, timeout and cancel).
- ``GET /_emulator/logs/{execution or task name}`` -> the attempts' combined logs (text).
- ``GET /_emulator/attempts/{execution or task name}`` -> ``{"attempts": [{"task", "index",
  "attempt", "startTime", "endTime", "seconds", "exitCode", "termSignal", "statusCode",
  "message", "stopReason", "log"}]}``: every ended attempt (``stopReason`` is ``preempted``,
  ``timeout``, ``cancelled`` or null), e.g. to count GPU-seconds spent for a goodput figure; still
  served after the execution or its job was deleted (the last 1,000 deleted executions per region).
  With FUSE volumes each record also has ``fuseEvents``: the attempt's gcsfuse events (staged
  writes with cause and bytes, throttled rewrites, non-atomic renames, ``ESTALE``, reads; see
  :mod:`.gcsfuse`), which the logs above also list in a last ``gcsfuse events`` section.
- ``GET /_emulator/volumes`` -> ``{"type": "fuse"|"folder", "reason", "strict", "mounts",
  "summary"}``: how volumes are served and the counts of all their events.

Cloud Logging: ``POST /v2/entries:list`` serves the attempts' logs as log entries (see
:mod:`.logging_api`), for the ``google-cloud-logging`` client with its ``api_endpoint`` here.

Every request first passes :class:`~.guards.GuardMiddleware` (loopback ``Host``, no foreign
``Origin``, ``application/json`` bodies, at most 4 MiB). Errors from the backend are serialized
here, once, into Google's JSON error shape.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Optional, Sequence

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from google.protobuf import json_format
from google.protobuf.message import Message
from starlette.concurrency import run_in_threadpool

from . import logging_api, responses, rpcs, urls
from .backend import Registry
from .exceptions import EmulatorError, InvalidArgument, NotFound, Unimplemented
from .faults import ApiFaults, FaultConfig, PreemptionPlan, PreemptionSchedule
from .gcsfuse import event_line
from .guards import GuardMiddleware, contained
from .quota import RequestQuota
from .rpcs import internal_error
from .runtime import policy_value

_TASK_NAME = "/tasks/"


@dataclasses.dataclass
class AppState:
    """Everything the handlers need, passed explicitly.

    :param registry: the backends.
    :param faults: API fault injector.
    :param gcs: the :class:`~.gcs.GcsService`.
    :param data_dir: emulator data directory.
    :param schedule: the seeded preemption schedule (one is made if not given).
    :param mounts: the :class:`~.gcsfuse.VolumeMounts` (FUSE volumes and their events), or ``None``.
    :param quota: the API request quota and counters, shared with the gRPC server (default:
        Cloud Run's limits, see :mod:`.quota`).
    :param services: the other APIs' services on the gRPC port (Cloud Build's and Artifact
        Registry's, :func:`~.cloud_build.services`), whose ``reset()`` forgets their resources.
    """

    registry: Registry
    faults: ApiFaults
    gcs: object
    data_dir: Path
    schedule: Optional[PreemptionSchedule] = None
    logging_requests: int = 0
    mounts: Optional[object] = None
    quota: RequestQuota = dataclasses.field(default_factory=RequestQuota)
    services: Sequence = ()

    def __post_init__(self) -> None:
        if self.schedule is None:
            self.schedule = PreemptionSchedule(self.registry)


def error_response(err: EmulatorError) -> JSONResponse:
    """The single place errors become HTTP responses."""
    return JSONResponse(status_code=err.http_code, content=err.to_dict())


def serialize(message, int_enums: bool) -> Response:
    """A protobuf or proto-plus message as camelCase JSON."""
    pb = message if isinstance(message, Message) else type(message).pb(message)
    text = json_format.MessageToJson(pb, use_integers_for_enums=int_enums)
    return Response(content=text, media_type="application/json")


def dispatch(state: AppState, method: str, path: str, query: dict, body: bytes) -> Response:
    """Route one ``/v2`` request to its method's request message, run it with
    :func:`~.rpcs.call` (quota, faults, the registry's lock, the same handler as gRPC), map errors."""
    int_enums = "enum-encoding=int" in query.get("$alt", "")
    try:
        found = urls.match(method, path)
        if found is None:
            if urls.path_exists(path):
                raise Unimplemented(f"Method {method} is not supported on /v2/{path}.")
            raise NotFound(f"The requested URL /v2/{path} was not found on this server.")
        builder, params, rpc = found
        request = builder(responses.Request(params, query, body))
        return rpcs.call(state.registry, state.faults, state.quota, rpc, request,
                         lambda result: serialize(result, int_enums))
    except EmulatorError as err:
        return error_response(err)
    except Exception as exc:  # an emulator bug: still answer in Google's error shape
        return error_response(internal_error(exc))


def _locked(cond, func, *args):
    with cond:
        return func(*args)


def _reset_services(services: Sequence) -> None:
    """Forget the other APIs' resources (the caller holds the registry's lock)."""
    for service in services:
        service.reset()


def create_app(state: AppState) -> FastAPI:
    """Build the application around ``state``."""
    app = FastAPI(title="Cloud Run Admin API v2 emulator", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(GuardMiddleware)  # loopback Host, no foreign Origin, JSON only, body limit
    _add_admin_routes(app, state)

    @app.post("/v2/entries:list")
    async def entries_list(request: HttpRequest) -> Response:
        state.logging_requests += 1
        body = await _json_body(request)
        return JSONResponse(await run_in_threadpool(_list_entries, state, body))

    @app.api_route("/v2/{path:path}", methods=["GET", "POST", "PATCH", "DELETE"])
    async def v2(path: str, request: HttpRequest) -> Response:
        body = await request.body()
        query = dict(request.query_params)
        return await run_in_threadpool(dispatch, state, request.method, path, query, body)

    return app


async def _json_body(request: HttpRequest) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw or b"{}")
    except ValueError:  # also UnicodeDecodeError
        raise InvalidArgument("Invalid JSON body.") from None
    except RecursionError:
        raise InvalidArgument("Invalid JSON body: nested too deeply.") from None
    if not isinstance(body, dict):
        raise InvalidArgument(f"Invalid JSON body: expected an object, got {type(body).__name__}.")
    return body


def _add_admin_routes(app: FastAPI, state: AppState) -> None:
    @app.exception_handler(EmulatorError)
    async def _on_error(_request, err: EmulatorError):
        return error_response(err)

    @app.exception_handler(Exception)
    async def _on_bug(_request, exc: Exception):
        return error_response(internal_error(exc))

    @app.get("/_emulator/health")
    def health():
        config = state.registry.config
        return {"status": "ok", "gcsEndpoint": state.gcs.endpoint, "loggingRequests": state.logging_requests,
                "taskProcesses": config.slots.describe(config.policy.max_task_processes)}

    @app.post("/_emulator/reset")
    async def reset(request: HttpRequest):
        body = await _json_body(request)
        state.schedule.stop()
        await run_in_threadpool(state.registry.reset)
        await run_in_threadpool(_locked, state.registry.cond, _reset_services, state.services)
        state.quota.reset()
        if state.mounts is not None:
            await run_in_threadpool(state.mounts.stop)
        if body.get("gcs"):
            state.gcs.wipe()
        return {"reset": True}

    @app.post("/_emulator/faults")
    async def faults(request: HttpRequest):
        config = FaultConfig.from_json(await _json_body(request))
        state.faults.configure(config)
        return dataclasses.asdict(config)

    _add_schedule_routes(app, state)
    _add_quota_routes(app, state)

    @app.post("/_emulator/transitions")
    async def transitions(request: HttpRequest):
        body = await _json_body(request)
        return await run_in_threadpool(_locked, state.registry.cond, apply_transitions, state.registry.config.policy, body)

    @app.post("/_emulator/preempt")
    async def preempt(request: HttpRequest):
        return await run_in_threadpool(_preempt, state, await _json_body(request))

    _add_report_routes(app, state)


def _add_report_routes(app: FastAPI, state: AppState) -> None:
    """What happened: attempts, logs, volumes."""

    @app.get("/_emulator/attempts/{name:path}")
    def attempts(name: str):
        records = state.registry.for_name(name, "name").attempts(name)
        if state.mounts is not None and state.mounts.fuse:
            events = state.mounts.events()
            for record in records:
                execution = record["task"].split("/executions/")[-1].split("/")[0]
                record["fuseEvents"] = [ev for ev in events if ev.get("execution") == execution
                                        and ev.get("taskIndex") == record["index"]
                                        and ev.get("attempt") == record["attempt"]]
        return {"attempts": records}

    @app.get("/_emulator/logs/{name:path}")
    def logs(name: str):
        return PlainTextResponse(read_logs(state.data_dir, name) + _fuse_log(state, name))

    @app.get("/_emulator/volumes")
    def volumes():
        if state.mounts is None:
            return {"type": "folder", "reason": "", "strict": False, "mounts": [], "summary": {}}
        return state.mounts.describe()


def _list_entries(state: AppState, body: dict) -> dict:
    executions = {}
    for backend in state.registry.backends():
        with state.registry.cond:
            executions.update({name.rsplit("/", 1)[-1]: e for name, e in backend.executions.items()})
    with state.registry.cond:
        return logging_api.list_entries(body, state.data_dir, executions)


def _add_schedule_routes(app: FastAPI, state: AppState) -> None:
    path = "/_emulator/preemptions/schedule"

    @app.post(path)
    async def start_schedule(request: HttpRequest):
        return state.schedule.start(PreemptionPlan.from_json(await _json_body(request)))

    @app.get(path)
    def schedule_status():
        return state.schedule.status()

    @app.delete(path)
    def stop_schedule():
        return state.schedule.stop()


def _add_quota_routes(app: FastAPI, state: AppState) -> None:
    """The request quota's settings and the request counters (see :mod:`.quota`)."""

    @app.get("/_emulator/quota")
    def quota():
        return state.quota.describe()

    @app.post("/_emulator/quota")
    async def set_quota(request: HttpRequest):
        try:
            settings = state.quota.settings.updated(await _json_body(request))
        except ValueError as exc:
            raise InvalidArgument(f"{exc}.") from None
        state.quota.configure(settings)
        return state.quota.describe()

    @app.get("/_emulator/requests")
    def requests(project: Optional[str] = None, region: Optional[str] = None):
        return state.quota.counters(project, region)

    @app.delete("/_emulator/requests")
    def reset_requests():
        return state.quota.counters(reset=True)


_TRANSITION_KEYS = {
    "taskStartDelaySeconds": ("start_delay_seconds", "float"),
    "preemptionConsumesRetry": ("preemption_consumes_retry", "bool"),
    "graceSeconds": ("grace_seconds", "float"),
    "gpuQuota": ("gpu_quota", "int"),
    "maxTaskProcesses": ("max_task_processes", "int"),
}


def apply_transitions(policy, body: dict) -> dict:
    """Change :class:`~.runtime.RuntimePolicy` settings; answer with all of them. Unknown keys
    are an error."""
    unknown = set(body) - set(_TRANSITION_KEYS)
    if unknown:
        raise InvalidArgument(f"unknown settings {sorted(unknown)}; known: {sorted(_TRANSITION_KEYS)}")
    checked = {}
    for key, value in body.items():  # all checked before any is applied
        attr, kind = _TRANSITION_KEYS[key]
        if kind == "bool":
            if not isinstance(value, bool):
                raise InvalidArgument(f"{key}: must be true or false.")
            checked[attr] = value
            continue
        try:
            checked[attr] = policy_value(attr, value)
        except ValueError as exc:
            raise InvalidArgument(f"{key}: {exc}.") from None
    for attr, value in checked.items():
        setattr(policy, attr, value)
    return {key: getattr(policy, attr) for key, (attr, _) in _TRANSITION_KEYS.items()}


def _preempt(state: AppState, body: dict) -> dict:
    try:
        if "task" in body:
            field = "task"
            execution, _, task = str(body["task"]).partition(_TASK_NAME)
            index = int(task.rsplit("-task", 1)[-1]) if "-task" in task else -1
        elif "execution" in body:
            raw_index = body.get("taskIndex", 0)
            if isinstance(raw_index, bool) or not isinstance(raw_index, int) or raw_index < 0:
                raise InvalidArgument(f"taskIndex: must be an integer >= 0, got {raw_index!r}.")
            field = "execution"
            execution, index = str(body["execution"]), raw_index
        else:
            raise InvalidArgument("execution: give 'execution' (and 'taskIndex') or 'task'.")
        grace = float(body.get("graceSeconds", state.registry.config.policy.grace_seconds))
        wait = float(body.get("waitSeconds", 10.0))
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"Invalid preempt request: {exc}") from None
    for key, value, limit in (("graceSeconds", grace, 3600.0), ("waitSeconds", wait, 3600.0)):
        if not 0 <= value <= limit:
            raise InvalidArgument(f"{key}: must be between 0 and {limit:g} seconds, got {value!r}.")
    return state.registry.for_name(execution, field).preempt(execution, index, grace, wait)


#: An execution or task name as the emulator makes them (the log folder is the execution's id).
_LOG_NAME = re.compile(
    r"^projects/[^/]+/locations/[^/]+/jobs/[a-z][-a-z0-9]*/executions/(?P<execution>[a-z][-a-z0-9]*)"
    r"(?:/tasks/(?P=execution)-task(?P<index>[0-9]+))?/?$")


def _fuse_log(state: AppState, name: str) -> str:
    """The FUSE volume events of an execution or task, one line each, as a last log section."""
    found = _LOG_NAME.match(name)
    if state.mounts is None or not state.mounts.fuse or not found:
        return ""
    index = found.group("index")
    events = state.mounts.events(found.group("execution"), int(index) if index is not None else None)
    if not events:
        return ""
    return "==> gcsfuse events <==\n" + "".join(event_line(ev) + "\n" for ev in events)


def read_logs(data_dir: Path, name: str) -> str:
    """Concatenated attempt logs of an execution, or of one task when ``name`` is a task.

    :raises InvalidArgument: when ``name`` is not an execution or task name.
    :raises NotFound: when there are no logs.
    """
    found = _LOG_NAME.match(name)
    if not found:
        raise InvalidArgument(f"name: '{name}' is not an execution or task name.")
    log_dir = contained(Path(data_dir, "logs"), found.group("execution"))
    index = found.group("index")
    prefix = f"task{index}-" if index is not None else "task"
    files = sorted(log_dir.glob(f"{prefix}*.log"), key=lambda p: p.name) if log_dir.is_dir() else []
    if not files:
        raise NotFound(f"No logs for '{name}'.")
    return "".join(f"==> {p.name} <==\n{p.read_text(errors='replace')}\n" for p in files)
