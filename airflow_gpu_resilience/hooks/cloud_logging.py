"""Read a Cloud Run execution's container logs from Cloud Logging (``entries:list``), within quota.

The execute operator's ``log_container_output`` option uses this to copy the platform's and the
worker's lines ("SIGTERM received; stopping at step ...", "resuming from step ...", the
maintenance message) into the Airflow task log. It calls the real ``google-cloud-logging``
client (HTTP transport) with the connection's credentials; the caller needs
``roles/logging.viewer`` (``logging.logEntries.list``) on the project.

Quota: Cloud Logging allows 60 ``entries:list`` requests per minute per project (all readers
together), so :class:`ExecutionLogFollower` spaces its requests (default at most 12 a minute,
``max_requests_per_minute``) and pages at most ``max_pages`` per read; a read it has no
request left for is skipped and the next one catches up (nothing is lost: it reads on from the
last timestamp it saw). Every entry is returned once: it remembers the newest timestamp and the
``insertId`` of the entries at that timestamp.

Endpoint: the constructor's ``api_endpoint``, else the connection extra ``logging_api_endpoint``,
else the connection extra ``api_endpoint`` when it is a plain ``http://`` one (the local emulator
serves ``POST /v2/entries:list`` beside the Cloud Run API), else Google's.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from airflow.providers.google.common.hooks.base_google import GoogleBaseHook

log = logging.getLogger(__name__)

#: Cloud Logging's read quota: ``entries:list`` requests per minute per project.
PROJECT_READ_QUOTA_PER_MINUTE = 60
LABEL = "run.googleapis.com/"


@dataclass(frozen=True)
class ContainerLogLine:
    """One log entry of an execution, as copied to the task log.

    :param timestamp: the entry's time (UTC).
    :param task_index: Cloud Run task index (-1 when the entry has none).
    :param attempt: the task attempt (-1 when unknown).
    :param severity: the entry's severity (``DEFAULT`` when unset).
    :param message: the text (a JSON payload's ``message``, else the whole payload).
    :param system: whether the platform wrote it (``varlog/system``) rather than the container.
    :param insert_id: the entry's ``insertId``.
    """

    timestamp: dt.datetime
    task_index: int
    attempt: int
    severity: str
    message: str
    system: bool
    insert_id: str

    def describe(self) -> str:
        """``task 0 attempt 1 WARNING: SIGTERM received; stopping at step 95`` (``[platform]`` for system lines)."""
        who = "[platform] " if self.system else ""
        return f"task {self.task_index} attempt {self.attempt} {self.severity}: {who}{self.message}"


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def to_line(entry: Any) -> ContainerLogLine:
    """A ``google.cloud.logging`` entry (text or struct) as a :class:`ContainerLogLine`."""
    payload = entry.payload
    message = payload.get("message", payload) if isinstance(payload, dict) else payload
    labels = entry.labels or {}
    return ContainerLogLine(
        timestamp=entry.timestamp, task_index=_int(labels.get(f"{LABEL}task_index")),
        attempt=_int(labels.get(f"{LABEL}task_attempt")), severity=str(entry.severity or "DEFAULT"),
        message=str(message), system="varlog%2Fsystem" in (entry.log_name or "") or "varlog/system" in (entry.log_name or ""),
        insert_id=str(entry.insert_id or ""),
    )


class CloudRunLogsHook(GoogleBaseHook):
    """Cloud Logging reader for Cloud Run job executions.

    :param gcp_conn_id: Airflow connection id (default ``google_cloud_default``).
    :param impersonation_chain: service account (or chain) to impersonate, or ``None``.
    :param api_endpoint: Logging endpoint override (see the module docstring for the default).
    """

    conn_name_attr = "gcp_conn_id"
    default_conn_name = "google_cloud_default"
    conn_type = "google_cloud_platform"
    hook_name = "Cloud Logging for Cloud Run GPU jobs"

    def __init__(self, gcp_conn_id: str = default_conn_name, impersonation_chain: str | Sequence[str] | None = None,
                 api_endpoint: str | None = None, **kwargs: Any) -> None:
        super().__init__(gcp_conn_id=gcp_conn_id, impersonation_chain=impersonation_chain, **kwargs)
        self._api_endpoint = api_endpoint
        self._logging_client: Any = None

    @property
    def api_endpoint(self) -> str | None:
        """The Logging endpoint in use, or ``None`` for Google's."""
        if self._api_endpoint:
            return self._api_endpoint
        explicit = self._get_field("logging_api_endpoint")
        if explicit:
            return explicit
        shared = self._get_field("api_endpoint") or ""
        return shared if shared.startswith("http://") else None

    def client(self, project_id: str) -> Any:
        """The ``google.cloud.logging.Client`` (HTTP transport), built once."""
        if self._logging_client is None:
            from google.cloud import logging as cloud_logging

            options = {"api_endpoint": self.api_endpoint} if self.api_endpoint else None
            self._logging_client = cloud_logging.Client(
                project=project_id, credentials=self.get_credentials(), client_options=options, _use_grpc=False,
            )
        return self._logging_client


def execution_filter(execution: str, since: dt.datetime | None, strict: bool = False) -> str:
    """The ``entries:list`` filter of one execution's entries at or after ``since``.

    :param execution: full execution name (``projects/P/locations/L/jobs/J/executions/E``).
    :param since: the earliest timestamp (UTC), or ``None`` for all.
    :param strict: after ``since`` only (``>``), not at or after it (``>=``).
    :raises ValueError: ``execution`` is not a full execution name.
    """
    parts = execution.split("/")
    if len(parts) != 8 or parts[0] != "projects" or parts[4] != "jobs" or parts[6] != "executions":
        raise ValueError(f"execution={execution!r} must be projects/P/locations/L/jobs/J/executions/E")
    clauses = ['resource.type="cloud_run_job"', f'resource.labels.job_name="{parts[5]}"',
               f'labels."{LABEL}execution_name"="{parts[7]}"']
    if since is not None:
        stamp = since.astimezone(dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
        clauses.append(f'timestamp{">" if strict else ">="}"{stamp}"')
    return " AND ".join(clauses)


class ExecutionLogFollower:
    """Reads an execution's new log entries, each once, within a request budget.

    :param hook: the Logging hook.
    :param execution: full execution name.
    :param max_requests_per_minute: ``entries:list`` requests this follower may make per minute
        (default 12, a fifth of the project's quota of 60; 1..60).
    :param max_pages: pages (requests) per :meth:`read` (default 3; at most 1000 entries a page).
    :param since: the earliest entry time to read (e.g. the execution's ``create_time``); default
        ``None``: the client's default window, the last 24 hours.
    :param clock: monotonic clock (seconds).
    :raises ValueError: a limit out of range, or a malformed ``execution``.
    """

    PAGE_SIZE = 1000

    def __init__(self, hook: CloudRunLogsHook, execution: str, *, max_requests_per_minute: int = 12,
                 max_pages: int = 3, since: dt.datetime | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(max_requests_per_minute, bool) or not 1 <= int(max_requests_per_minute) <= PROJECT_READ_QUOTA_PER_MINUTE:
            raise ValueError(f"max_requests_per_minute={max_requests_per_minute!r} must be in 1..{PROJECT_READ_QUOTA_PER_MINUTE}")
        if isinstance(max_pages, bool) or int(max_pages) < 1:
            raise ValueError(f"max_pages={max_pages!r} must be an integer >= 1")
        execution_filter(execution, None)
        self.hook, self.execution = hook, execution
        self.project_id = execution.split("/")[1]
        self.max_requests_per_minute, self.max_pages, self._clock = int(max_requests_per_minute), int(max_pages), clock
        self._requests: deque[float] = deque()
        self._since: dt.datetime | None = since
        self._seen_at_since: set[str] = set()
        self.requests_made = 0
        self._last_page_size = 0
        self._strict = False

    def _may_request(self) -> bool:
        now = self._clock()
        while self._requests and now - self._requests[0] >= 60.0:
            self._requests.popleft()
        return len(self._requests) < self.max_requests_per_minute

    def _wait_for_request(self, sleep: Callable[[float], None]) -> None:
        while not self._may_request():
            sleep(max(0.05, 60.0 - (self._clock() - self._requests[0])))

    def drain(self, sleep: Callable[[float], None] = time.sleep) -> list[ContainerLogLine]:
        """Every entry not returned before (a finished execution's rest), waiting for request budget.

        :param sleep: sleeps that many seconds when the minute's requests are used up.
        :raises google.api_core.exceptions.GoogleAPICallError: as :meth:`read`.
        """
        lines: list[ContainerLogLine] = []
        while True:
            self._wait_for_request(sleep)
            before = self.requests_made
            page = self.read(max_pages=1, spaced=False)
            lines.extend(page)
            if self.requests_made == before or self._last_page_size < self.PAGE_SIZE:
                return lines

    def read(self, max_pages: int | None = None, spaced: bool = True) -> list[ContainerLogLine]:
        """The entries not returned before, oldest first; ``[]`` when out of requests (caught up later).

        :param max_pages: requests at most (default the follower's ``max_pages``).
        :param spaced: make no request within ``60 / max_requests_per_minute`` seconds (5 s by
            default) of the last one, so that polling often leaves budget for :meth:`drain`.

        :raises google.api_core.exceptions.GoogleAPICallError: a failed request (e.g.
            ``PermissionDenied`` without ``roles/logging.viewer``).
        """
        lines: list[ContainerLogLine] = []
        if spaced and self._requests and self._clock() - self._requests[-1] < 60.0 / self.max_requests_per_minute:
            return lines
        for _ in range(max_pages or self.max_pages):
            if not self._may_request():
                log.debug("Log read of %s deferred: %s requests in the last minute", self.execution,
                          self.max_requests_per_minute)
                break
            self._requests.append(self._clock())
            self.requests_made += 1
            # one request: one page of at most PAGE_SIZE entries; the next page is asked for by
            # timestamp (>= the newest seen, its insertIds skipped), not by page token
            entries = list(self.hook.client(self.project_id).list_entries(
                resource_names=[f"projects/{self.project_id}"], filter_=execution_filter(self.execution, self._since, self._strict),
                order_by="timestamp asc", page_size=self.PAGE_SIZE, max_results=self.PAGE_SIZE,
            ))
            self._last_page_size = len(entries)
            fresh = self._new(to_line(e) for e in entries)
            stuck = not fresh and self._strict
            # a full page of entries already seen (a page or more at one timestamp): step past it
            self._strict = not fresh and len(entries) == self.PAGE_SIZE
            lines.extend(fresh)
            if len(entries) < self.PAGE_SIZE or stuck:
                self._last_page_size = 0
                break
                break
        return lines

    def _new(self, lines: Any) -> list[ContainerLogLine]:
        fresh = []
        for line in lines:
            if self._since is not None and (line.timestamp < self._since or
                                            (line.timestamp == self._since and line.insert_id in self._seen_at_since)):
                continue
            if self._since is None or line.timestamp > self._since:
                self._since, self._seen_at_since = line.timestamp, set()
            self._seen_at_since.add(line.insert_id)
            fresh.append(line)
        return fresh
