"""Cloud Run Admin API request quotas and per-method request counters, for both transports.

:func:`~.rpcs.call` asks :meth:`RequestQuota.admit` first for every API request, REST or gRPC,
so both see one quota and one set of counters. Admin endpoints (``/_emulator``), Cloud Logging
and the GCS emulator are neither counted nor limited.

Quotas. Cloud Run limits Admin API requests per project and region in rate quotas, listed on
its quotas page as "Read requests per minute per region" (quota metric
``run.googleapis.com/read_regional``, limit ``ReadPerMinutePerProjectRegion``) and "Write
requests per minute per region" (``run.googleapis.com/write_regional``,
``WritePerMinutePerProjectRegion``). The page names the limits but not their defaults, so the
defaults here are the values public projects record: reads 600 per minute; writes 60 per minute
(some projects record 30). Cloud Run's third rate quota, "Job run requests per minute per
region", is not emulated apart: a RunJob counts as a write. A limit of 0 turns that quota off.

Kinds (:data:`KINDS`): a method that changes state (:attr:`~.rpcs.Rpc.mutating`: CreateJob,
UpdateJob, DeleteJob, RunJob, DeleteExecution, CancelExecution, DeleteOperation) is a write;
every other (GetJob, ListJobs, GetExecution, ListExecutions, GetTask, ListTasks, GetOperation,
ListOperations, WaitOperation) is a read.

Scope. A request is charged to the project and region of the resource name it carries (its
``name``, ``parent`` or ``job.name``; operations too: ``projects/P/locations/R/operations/...``).
A request whose name has no ``projects/P/locations/R`` prefix is counted under ``-`` and not
limited (it fails with INVALID_ARGUMENT anyway).

Window. A sliding window of ``window_seconds`` (60; shorter only to keep tests short): a request
is admitted when fewer than the limit's requests of its kind, project and region were admitted
in the window before it; a rejected request uses none of the quota. Google refills some rate
quotas at fixed minute boundaries; a sliding window never admits more in any span of the window's
length, so a client that never sees 429 here never sees it there either.

Answer. An exhausted quota is HTTP 429, ``RESOURCE_EXHAUSTED`` (gRPC code 8), with the message
Google's quota errors carry, e.g. ``Quota exceeded for quota metric 'Read requests' and limit
'Read requests per minute per region' of service 'run.googleapis.com' for consumer
'project_number:123456789012'.``, and two details: a ``google.rpc.ErrorInfo`` (reason
``RATE_LIMIT_EXCEEDED``, domain ``googleapis.com``, metadata ``service``, ``consumer``,
``quota_metric``, ``quota_limit``, ``quota_limit_value``, ``quota_location``, ``quota_unit``) and a
``google.rpc.Help`` link to request more, as in the errors Google's frontends return (see
:mod:`.exceptions` for how each transport carries them). The emulator has no project numbers:
the consumer is a stable 12-digit number derived from the project id (a numeric id is used as it is).

Counters (:meth:`RequestQuota.counters`): every request to a method, per (project, region) and
method, and how many of them the quota rejected, since the start or the last reset.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import threading
import time
from typing import Optional

from google.rpc import error_details_pb2

from .backend import NAME
from .exceptions import ResourceExhausted

SERVICE = "run.googleapis.com"
#: The two kinds of request a quota counts: reads and writes (the mutating methods).
READ, WRITE = "read", "write"
#: The scope of a request whose name carries no project and region.
NO_SCOPE = "-"
#: Link of the ``google.rpc.Help`` detail of a quota error (Google's page on quota increases).
HELP_URL = "https://cloud.google.com/docs/quotas/help/request_increase"


@dataclasses.dataclass(frozen=True)
class Quota:
    """One Cloud Run rate quota, as its errors name it.

    :param metric: the quota metric's display name, e.g. ``Read requests``.
    :param limit: the limit's display name.
    :param metric_id: the quota metric, e.g. ``run.googleapis.com/read_regional``.
    :param limit_id: the limit's id, e.g. ``ReadPerMinutePerProjectRegion``.
    :param default: requests per minute per project and region (see the module docstring).
    """

    metric: str
    limit: str
    metric_id: str
    limit_id: str
    default: int


#: The quota of each kind of request.
KINDS = {
    READ: Quota("Read requests", "Read requests per minute per region", f"{SERVICE}/read_regional",
                "ReadPerMinutePerProjectRegion", 600),
    WRITE: Quota("Write requests", "Write requests per minute per region", f"{SERVICE}/write_regional",
                 "WritePerMinutePerProjectRegion", 60),
}
#: Longest window (s) the settings accept.
MAX_WINDOW_SECONDS = 3600.0


def kind_of(mutating: bool) -> str:
    """:param mutating: whether the method changes state (:attr:`~.rpcs.Rpc.mutating`).
    :return: :data:`WRITE` or :data:`READ`."""
    return WRITE if mutating else READ


def checked_limit(name: str, value) -> int:
    """A quota limit as the settings take it.

    :param name: the setting as the user wrote it (a flag or a JSON key), for the error.
    :param value: the value given.
    :return: ``value``, an integer >= 0 (0: the quota is off).
    :raises ValueError: naming ``name`` and the allowed values, for anything else.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0 (requests per minute; 0 turns the quota off), got {value!r}")
    return value


def checked_window(name: str, value) -> float:
    """The quota window as the settings take it.

    :param name: the setting as the user wrote it, for the error.
    :param value: the value given.
    :return: ``value`` in seconds, more than 0 and at most :data:`MAX_WINDOW_SECONDS`.
    :raises ValueError: naming ``name`` and the allowed values, for anything else.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0 < value <= MAX_WINDOW_SECONDS):
        raise ValueError(f"{name} must be a number of seconds > 0 and <= {MAX_WINDOW_SECONDS:g} "
                         f"(60 is Cloud Run's minute), got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class QuotaSettings:
    """The quota's settings (``serve --read-quota-per-minute --write-quota-per-minute
    --quota-window-seconds``; ``POST /_emulator/quota``).

    :param reads_per_minute: read requests admitted per window, per project and region
        (default 600; 0: off).
    :param writes_per_minute: write requests likewise (default 60; 0: off).
    :param window_seconds: the window's length in seconds (default 60, Cloud Run's minute).
    """

    reads_per_minute: int = KINDS[READ].default
    writes_per_minute: int = KINDS[WRITE].default
    window_seconds: float = 60.0

    #: JSON key -> (attribute, checker).
    JSON_KEYS = {"readRequestsPerMinute": ("reads_per_minute", checked_limit),
                 "writeRequestsPerMinute": ("writes_per_minute", checked_limit),
                 "windowSeconds": ("window_seconds", checked_window)}

    def limit(self, kind: str) -> int:
        """:param kind: :data:`READ` or :data:`WRITE`. :return: its limit (0: off)."""
        return self.reads_per_minute if kind == READ else self.writes_per_minute

    def updated(self, body: dict) -> "QuotaSettings":
        """These settings with the JSON keys of ``body`` changed (all checked first).

        :param body: any of ``readRequestsPerMinute``, ``writeRequestsPerMinute``, ``windowSeconds``.
        :raises ValueError: naming the key, for an unknown key or a bad value.
        """
        unknown = sorted(set(body) - set(self.JSON_KEYS))
        if unknown:
            raise ValueError(f"unknown settings {unknown}; known: {sorted(self.JSON_KEYS)}")
        changes = {self.JSON_KEYS[key][0]: self.JSON_KEYS[key][1](key, value) for key, value in body.items()}
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        return {key: getattr(self, attr) for key, (attr, _) in self.JSON_KEYS.items()}


def project_number(project: str) -> str:
    """The consumer number of a project in quota errors: a numeric id as it is, else a stable
    12-digit number derived from the id (the emulator has no project numbers)."""
    if project.isdigit():
        return project
    return str(10**11 + int.from_bytes(hashlib.sha256(project.encode()).digest()[:8], "big") % (9 * 10**11))


def quota_error(kind: str, project: str, region: str, limit: int) -> ResourceExhausted:
    """The error Cloud Run answers when ``kind``'s quota of (``project``, ``region``) is used up.

    :param kind: :data:`READ` or :data:`WRITE`.
    :param project: project id.
    :param region: region.
    :param limit: the limit in force.
    """
    quota, number = KINDS[kind], project_number(project)
    message = (f"Quota exceeded for quota metric '{quota.metric}' and limit '{quota.limit}' of service "
               f"'{SERVICE}' for consumer 'project_number:{number}'.")
    info = error_details_pb2.ErrorInfo(reason="RATE_LIMIT_EXCEEDED", domain="googleapis.com", metadata={
        "service": SERVICE, "consumer": f"projects/{number}", "quota_metric": quota.metric_id,
        "quota_limit": quota.limit_id, "quota_limit_value": str(limit), "quota_location": region,
        "quota_unit": "1/min/{project}/{region}"})
    help_link = error_details_pb2.Help(links=[error_details_pb2.Help.Link(
        description="Request a higher quota limit.", url=HELP_URL)])
    return ResourceExhausted(message, details=(info, help_link))


def scope_of(name: str) -> tuple:
    """``(project, region)`` of a resource or parent name, or ``(NO_SCOPE, NO_SCOPE)``."""
    found = NAME.match(name or "")
    return (found.group("p"), found.group("l")) if found else (NO_SCOPE, NO_SCOPE)


class RequestQuota:
    """The quotas and counters of one emulator, shared by both transports (thread-safe).

    :param settings: the limits and window (default: Cloud Run's, see :class:`QuotaSettings`).
    :param clock: monotonic seconds (default :func:`time.monotonic`).
    """

    def __init__(self, settings: Optional[QuotaSettings] = None, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.settings = settings or QuotaSettings()
        self._admitted: dict = {}  # (project, region, kind) -> deque of admission times
        self._counts: dict = {}  # (project, region, method) -> [requests, rejected]

    def admit(self, method: str, mutating: bool, name: str) -> None:
        """Count one request and charge it to its quota.

        :param method: the RPC's method, e.g. ``GetJob``.
        :param mutating: whether it changes state (a write).
        :param name: the resource or parent name it carries.
        :raises ResourceExhausted: the quota error, when its quota is used up (the request is
            counted as rejected and uses none of the quota).
        """
        project, region = scope_of(name)
        kind = kind_of(mutating)
        with self._lock:
            counts = self._counts.setdefault((project, region, method), [0, 0])
            counts[0] += 1
            limit = self.settings.limit(kind)
            if not limit or project == NO_SCOPE:
                return
            now = self._clock()
            admitted = self._admitted.setdefault((project, region, kind), collections.deque())
            while admitted and admitted[0] <= now - self.settings.window_seconds:
                admitted.popleft()
            if len(admitted) >= limit:
                counts[1] += 1
                raise quota_error(kind, project, region, limit)
            admitted.append(now)

    def configure(self, settings: QuotaSettings) -> None:
        """Use ``settings`` from now on (requests already admitted stay in their windows)."""
        with self._lock:
            self.settings = settings

    def describe(self) -> dict:
        """The settings' JSON and ``usage``: ``{"projects/P/locations/R": {"read": n, "write": n}}``,
        the requests admitted in the window now."""
        with self._lock:
            horizon, usage = self._clock() - self.settings.window_seconds, {}
            for (project, region, kind), admitted in self._admitted.items():
                used = sum(1 for at in admitted if at > horizon)
                if used:
                    usage.setdefault(f"projects/{project}/locations/{region}", {READ: 0, WRITE: 0})[kind] = used
            return {**self.settings.to_json(), "usage": usage}

    def counters(self, project: Optional[str] = None, region: Optional[str] = None, reset: bool = False) -> dict:
        """The request counters, of one project and/or region when given.

        :param project: only this project (``-``: requests without one).
        :param region: only this region.
        :param reset: zero all counters (every project's) after reading them.
        :return: ``{"total": {"requests", "quotaExceeded"}, "methods": {METHOD: {...}},
            "locations": {"projects/P/locations/R": {METHOD: {...}}}}`` (requests without a
            project and region under ``projects/-/locations/-``).
        """
        with self._lock:
            selected = [(key, list(value)) for key, value in self._counts.items()
                        if project in (None, key[0]) and region in (None, key[1])]
            if reset:
                self._counts.clear()
        total, methods, locations = _tally(), {}, {}
        for (p, r, method), (requests, rejected) in sorted(selected):
            for tally in (total, methods.setdefault(method, _tally()),
                          locations.setdefault(f"projects/{p}/locations/{r}", {}).setdefault(method, _tally())):
                tally["requests"] += requests
                tally["quotaExceeded"] += rejected
        return {"total": total, "methods": methods, "locations": locations}

    def reset(self) -> None:
        """Forget every window and counter (``POST /_emulator/reset``)."""
        with self._lock:
            self._admitted.clear()
            self._counts.clear()


def _tally() -> dict:
    return {"requests": 0, "quotaExceeded": 0}
