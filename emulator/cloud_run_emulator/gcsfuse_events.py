"""The FUSE volume's records (``events.jsonl``): who writes, how the mount process appends a
record, and how the emulator reads, counts and prints them.

A record is one JSON object per line: ``kind`` (one of :data:`EVENT_KINDS`), ``object`` (and
``bucket`` on the emulator's mounts of all buckets), ``time`` (epoch s), ``cause`` and ``bytes``
where they apply, and the writer's ``execution``, ``taskIndex`` and ``attempt`` (from its
``CLOUD_RUN_*`` environment) or ``pid``. What each kind means is gcsfuse's ``docs/semantics.md``
as the module docstring of :mod:`.gcsfuse` lists it. No FUSE library is imported here.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

#: The kinds of event a mount records.
EVENT_KINDS = ("staged", "throttled-rewrite", "non-atomic-rename", "estale", "read")


def identity(pid: int) -> dict:
    """The caller's identity: ``{"pid"}`` plus ``execution``, ``taskIndex`` and ``attempt`` from
    the ``CLOUD_RUN_*`` variables of process ``pid``'s environment, where it has them."""
    who = {"pid": pid}
    try:
        with open(f"/proc/{pid}/environ", "rb") as env:
            for item in env.read().split(b"\0"):
                key, _, value = item.partition(b"=")
                if key == b"CLOUD_RUN_EXECUTION":
                    who["execution"] = value.decode(errors="replace")
                elif key == b"CLOUD_RUN_TASK_INDEX" and value.isdigit():
                    who["taskIndex"] = int(value)
                elif key == b"CLOUD_RUN_TASK_ATTEMPT" and value.isdigit():
                    who["attempt"] = int(value)
    except OSError:
        pass
    return who


def task_of(who: dict):
    """``(execution, task index, attempt)`` of an :func:`identity`, ``None`` outside a task: the
    task whose mount (on Cloud Run, one per task) the writer writes through."""
    return (who["execution"], who.get("taskIndex"), who.get("attempt")) if "execution" in who else None


class EventLog:
    """The mount process's ``events.jsonl``, appended one line per record.

    :param path: the file (opened for append, line-buffered).
    :param buckets_root: the mount shows one folder per bucket: a record's first path component
        is its ``bucket`` (also stripped from ``to``).
    :raises OSError: when the file cannot be opened.
    """

    def __init__(self, path: str, buckets_root: bool) -> None:
        self.buckets_root = buckets_root
        self.file = open(path, "a", buffering=1)

    def record(self, kind: str, obj: str, who: Optional[dict] = None, **fields) -> None:
        """Append one record (a lost write, a full disk, is reported on stderr: the operation
        itself has happened).

        :param kind: one of :data:`EVENT_KINDS`.
        :param obj: the mount's path of the object (``/name``, ``/bucket/name``).
        :param who: the writer's :func:`identity`.
        :param fields: ``cause``, ``bytes``, ``to`` (a mount path without its leading ``/``), ...
        """
        name = obj.lstrip("/")
        bucket = {}
        if self.buckets_root:
            head, _, name = name.partition("/")
            bucket = {"bucket": head}
            if "to" in fields:
                fields["to"] = fields["to"].partition("/")[2]
        event = {"kind": kind, **bucket, "object": name, "time": round(time.time(), 6), **fields}
        event.update(who or {})
        try:
            self.file.write(json.dumps(event) + "\n")
        except (OSError, ValueError) as exc:
            print(f"gcsfuse: record lost ({exc}): {event}", file=sys.stderr, flush=True)


def read_events(path) -> list:
    """Records of an ``events.jsonl`` file (a torn last line is skipped)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def summarize(events: list) -> dict:
    """``{"staged", "stagedBytes", "throttled", "nonAtomicRenames", "estale", "bytesRead": {object: n},
    "causes": {cause: n}}`` of a list of records (objects named ``bucket/object`` where records
    name their bucket)."""
    out = {"staged": 0, "stagedBytes": 0, "throttled": 0, "nonAtomicRenames": 0, "estale": 0, "bytesRead": {},
           "causes": {}}
    for ev in events:
        kind = ev.get("kind")
        if kind == "staged":
            out["staged"] += 1
            out["stagedBytes"] += int(ev.get("bytes") or 0)
            out["causes"][ev.get("cause")] = out["causes"].get(ev.get("cause"), 0) + 1
        elif kind == "throttled-rewrite":
            out["throttled"] += 1
        elif kind == "non-atomic-rename":
            out["nonAtomicRenames"] += 1
        elif kind == "estale":
            out["estale"] += 1
        elif kind == "read":
            key = f"{ev['bucket']}/{ev['object']}" if "bucket" in ev else ev["object"]
            out["bytesRead"][key] = out["bytesRead"].get(key, 0) + int(ev.get("bytes") or 0)
    return out


def event_line(ev: dict) -> str:
    """One human-readable log line of a record."""
    extra = " ".join(f"{k}={ev[k]}" for k in ("cause", "bytes", "to", "refused", "seconds") if k in ev)
    who = f"task{ev['taskIndex']}-attempt{ev['attempt']}" if "taskIndex" in ev and "attempt" in ev else f"pid {ev.get('pid')}"
    name = f"{ev['bucket']}/{ev.get('object')}" if "bucket" in ev else ev.get("object")
    return f"gcsfuse {ev.get('kind')}: {name} {extra} ({who})".rstrip()
