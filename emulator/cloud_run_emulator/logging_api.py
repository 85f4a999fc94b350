"""A Cloud Logging ``entries:list`` endpoint over the emulator's attempt logs.

``POST /v2/entries:list`` (the Logging API v2 REST method the real ``google-cloud-logging``
client calls, with its ``api_endpoint`` client option pointed at the emulator) serves every
attempt's container output, ``{data_dir}/logs/{execution}/task{i}-attempt{n}.log``, as log
entries shaped like Cloud Run's:

- ``resource``: ``{"type": "cloud_run_job", "labels": {"project_id", "location", "job_name"}}``;
- ``labels``: ``run.googleapis.com/execution_name``, ``run.googleapis.com/task_index``,
  ``run.googleapis.com/task_attempt``;
- ``logName``: ``projects/{project}/logs/run.googleapis.com%2Fstdout`` for the container's
  lines (a JSON line becomes ``jsonPayload`` with its ``severity``, ``message`` and ``time`` as
  the entry's severity, payload and timestamp; any other line a ``textPayload``, timestamped
  one microsecond after the line before it), and ``.../run.googleapis.com%2Fvarlog%2Fsystem`` for the platform's
  line at each attempt's end (its status message, e.g. the maintenance message of a preemption);
- ``insertId``: ``{execution}-{index}-{attempt}-{line number}`` (unique, stable).

Filters: clauses joined by ``AND`` of ``FIELD OP "VALUE"`` with ``OP`` one of ``=``, ``>``,
``>=``, ``<``, ``<=`` and ``FIELD`` one of ``resource.type``, ``resource.labels.job_name``,
``resource.labels.location``, ``resource.labels.project_id``, ``logName``, ``severity`` (``>=``
compares severities), ``timestamp`` (RFC 3339), ``insertId`` and
``labels."run.googleapis.com/execution_name"`` / ``task_index`` / ``task_attempt``. Anything
else is ``INVALID_ARGUMENT`` naming what is supported. ``orderBy``: ``timestamp asc`` (default)
or ``timestamp desc``; ``pageSize`` up to 1000 (default 50); ``pageToken`` is an offset.

Each request is counted (``loggingRequests`` in ``GET /_emulator/health``), so a test can check
that a client made none.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Any, Iterable, Optional

from .exceptions import InvalidArgument

STDOUT_LOG = "run.googleapis.com%2Fstdout"
SYSTEM_LOG = "run.googleapis.com%2Fvarlog%2Fsystem"
LABEL = "run.googleapis.com/"
SEVERITIES = ("DEFAULT", "DEBUG", "INFO", "NOTICE", "WARNING", "ERROR", "CRITICAL", "ALERT", "EMERGENCY")
MAX_PAGE_SIZE = 1000
_FILE = re.compile(r"^task(?P<index>[0-9]+)-attempt(?P<attempt>[0-9]+)\.log$")
_CLAUSE = re.compile(r'^\s*(?P<field>[A-Za-z_.]+(?:"[^"]+")?)\s*(?P<op>>=|<=|=|>|<)\s*"(?P<value>[^"]*)"\s*$')
_FIELDS = ("resource.type", "resource.labels.job_name", "resource.labels.location", "resource.labels.project_id",
           "logName", "severity", "timestamp", "insertId", f'labels."{LABEL}execution_name"',
           f'labels."{LABEL}task_index"', f'labels."{LABEL}task_attempt"')


def _parse_time(value: str) -> Optional[dt.datetime]:
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (TypeError, ValueError):
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


def _rfc3339(when: dt.datetime) -> str:
    return when.astimezone(dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def parse_filter(text: str) -> list[tuple[str, str, str]]:
    """``[(field, op, value)]`` of a filter of ``AND``-joined clauses.

    :raises InvalidArgument: a clause that is not of the supported form, naming the fields.
    """
    clauses = []
    for part in re.split(r"\s+AND\s+", text.strip()) if text.strip() else []:
        found = _CLAUSE.match(part)
        if not found or found.group("field") not in _FIELDS:
            raise InvalidArgument(f"filter: unsupported clause {part.strip()!r}; the emulator supports "
                                  f"FIELD OP \"VALUE\" joined by AND, FIELD one of {', '.join(_FIELDS)}.")
        if found.group("field") == "timestamp" and _parse_time(found.group("value")) is None:
            raise InvalidArgument(f"filter: timestamp {found.group('value')!r} is not RFC 3339.")
        clauses.append((found.group("field"), found.group("op"), found.group("value")))
    return clauses


def _value(entry: dict, field: str) -> str:
    if field.startswith('labels."'):
        return entry["labels"].get(field[len('labels."'):-1], "")
    if field.startswith("resource."):
        node: Any = entry["resource"]
        for key in field.split(".")[1:]:
            node = node.get(key, "") if isinstance(node, dict) else ""
        return str(node)
    return str(entry.get(field, ""))


def _matches(entry: dict, clauses: Iterable[tuple[str, str, str]]) -> bool:
    for field, op, value in clauses:
        have: Any = _value(entry, field)
        want: Any = value
        if field == "timestamp":
            have, want = _parse_time(have), _parse_time(value)
        elif field == "severity":
            have = SEVERITIES.index(have) if have in SEVERITIES else 0
            want = SEVERITIES.index(value.upper()) if value.upper() in SEVERITIES else 0
        ok = {"=": have == want, ">": have > want, ">=": have >= want, "<": have < want, "<=": have <= want}[op]
        if not ok:
            return False
    return True


def _attempt_entries(path: Path, base: dict, prefix: str, started: Optional[dt.datetime]) -> list[dict]:
    entries, when = [], started or dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc)
    for number, line in enumerate(path.read_text(errors="replace").splitlines()):
        if not line.strip():
            continue
        entry = {**base, "insertId": f"{prefix}-{number}", "severity": "DEFAULT"}
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            when = _parse_time(str(record.get("time", ""))) or when
            severity = str(record.get("severity", "DEFAULT")).upper()
            entry.update(jsonPayload=record, severity=severity if severity in SEVERITIES else "DEFAULT")
        else:
            entry["textPayload"] = line
            when += dt.timedelta(microseconds=1)
        entry["timestamp"] = _rfc3339(when)
        entries.append(entry)
    return entries


def collect_entries(data_dir: Path, executions: dict[str, Any], project: str) -> list[dict]:
    """Every attempt's log entries plus one platform entry at each ended attempt's end.

    :param data_dir: the emulator's data folder (logs under ``logs/``).
    :param executions: execution short id -> its :class:`~.models.Execution` (for the job id,
        location and the attempts' times); an execution not there (deleted) is served from its
        files alone, its job name taken from its id.
    :param project: the project id of the request.
    """
    entries: list[dict] = []
    root = Path(data_dir, "logs")
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        execution = executions.get(folder.name)
        job = execution.job if execution is not None else folder.name.rsplit("-", 1)[0]
        location = execution.name.split("/")[3] if execution is not None else ""
        resource = {"type": "cloud_run_job", "labels": {"project_id": project, "location": location, "job_name": job}}
        history = {(t.index, h["attempt"]): h for t in execution.tasks for h in t.history} if execution else {}
        for path in sorted(folder.glob("task*-attempt*.log")):
            found = _FILE.match(path.name)
            if not found:
                continue
            index, attempt = int(found.group("index")), int(found.group("attempt"))
            labels = {f"{LABEL}execution_name": folder.name, f"{LABEL}task_index": str(index),
                      f"{LABEL}task_attempt": str(attempt)}
            base = {"resource": resource, "labels": labels, "logName": f"projects/{project}/logs/{STDOUT_LOG}"}
            ended = history.get((index, attempt))
            started = _parse_time(ended["startTime"]) if ended and ended.get("startTime") else None
            prefix = f"{folder.name}-{index}-{attempt}"
            entries.extend(_attempt_entries(path, base, prefix, started))
            if ended and ended.get("message"):
                entries.append({**base, "logName": f"projects/{project}/logs/{SYSTEM_LOG}",
                                "insertId": f"{prefix}-system", "severity": "WARNING" if ended["statusCode"] else "INFO",
                                "textPayload": ended["message"], "timestamp": _rfc3339(_parse_time(ended["endTime"]))})
    return entries


def list_entries(body: dict, data_dir: Path, executions: dict[str, Any]) -> dict:
    """Answer an ``entries:list`` request body.

    :raises InvalidArgument: no ``projects/P`` resource name, a bad filter, order or page size.
    """
    names = body.get("resourceNames") or []
    projects = [n.split("/", 1)[1] for n in names if isinstance(n, str) and n.startswith("projects/")]
    if not projects or len(projects) != len(names):
        raise InvalidArgument("resourceNames: give one or more 'projects/PROJECT_ID'.")
    clauses = parse_filter(str(body.get("filter") or ""))
    order = str(body.get("orderBy") or "timestamp asc").strip().lower()
    if order not in ("timestamp asc", "timestamp desc"):
        raise InvalidArgument(f"orderBy: must be 'timestamp asc' or 'timestamp desc', got {order!r}.")
    try:
        size = int(body.get("pageSize") or 50)
        offset = int(body.get("pageToken") or 0)
    except (TypeError, ValueError):
        raise InvalidArgument("pageSize and pageToken: must be integers.") from None
    if not 0 < size <= MAX_PAGE_SIZE or offset < 0:
        raise InvalidArgument(f"pageSize: must be in 1..{MAX_PAGE_SIZE}; pageToken: >= 0.")
    found = [e for p in projects for e in collect_entries(data_dir, executions, p) if _matches(e, clauses)]
    found.sort(key=lambda e: (e["timestamp"], e["insertId"]), reverse=order.endswith("desc"))
    page = found[offset:offset + size]
    answer: dict = {"entries": page}
    if offset + size < len(found):
        answer["nextPageToken"] = str(offset + size)
    return answer
