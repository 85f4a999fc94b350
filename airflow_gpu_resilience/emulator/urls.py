"""The declarative route table: (HTTP method, path pattern, handler name in :mod:`responses`).

Patterns match the path after ``/v2/``. Segments never contain ``/`` or ``:``, so the colon
verbs (``:run``, ``:cancel``, ``:wait``) are matched explicitly instead of by a path converter.
"""

from __future__ import annotations

import re

_SEG = r"[^/:]+"
_LOC = rf"projects/{_SEG}/locations/{_SEG}"
_JOB = rf"{_LOC}/jobs/{_SEG}"
_EXEC = rf"{_JOB}/executions/{_SEG}"
_OP = rf"{_LOC}/operations/{_SEG}"

ROUTES = [
    ("POST", rf"(?P<parent>{_LOC})/jobs", "create_job"),
    ("GET", rf"(?P<parent>{_LOC})/jobs", "list_jobs"),
    ("GET", rf"(?P<name>{_JOB})", "get_job"),
    ("PATCH", rf"(?P<name>{_JOB})", "update_job"),
    ("DELETE", rf"(?P<name>{_JOB})", "delete_job"),
    ("POST", rf"(?P<name>{_JOB}):run", "run_job"),
    ("GET", rf"(?P<parent>{_JOB})/executions", "list_executions"),
    ("GET", rf"(?P<name>{_EXEC})", "get_execution"),
    ("DELETE", rf"(?P<name>{_EXEC})", "delete_execution"),
    ("POST", rf"(?P<name>{_EXEC}):cancel", "cancel_execution"),
    ("GET", rf"(?P<parent>{_EXEC})/tasks", "list_tasks"),
    ("GET", rf"(?P<name>{_EXEC}/tasks/{_SEG})", "get_task"),
    ("GET", rf"(?P<name>{_LOC})/operations", "list_operations"),
    ("GET", rf"(?P<name>{_OP})", "get_operation"),
    ("POST", rf"(?P<name>{_OP}):wait", "wait_operation"),
    ("DELETE", rf"(?P<name>{_OP})", "delete_operation"),
]

COMPILED = [(method, re.compile(pattern + r"/?$"), handler) for method, pattern, handler in ROUTES]


def match(method: str, path: str):
    """``(handler_name, groups)`` for a ``/v2/``-relative path, or ``None``.

    :param method: HTTP method, upper case.
    :param path: the decoded path without the ``/v2/`` prefix.
    """
    for route_method, pattern, handler in COMPILED:
        found = pattern.match(path)
        if found and route_method == method:
            return handler, found.groupdict()
    return None


def path_exists(path: str) -> bool:
    """Whether any route matches ``path`` (to tell 405 from 404)."""
    return any(pattern.match(path) for _, pattern, _ in COMPILED)
