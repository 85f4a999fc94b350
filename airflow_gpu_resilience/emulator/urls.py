"""The declarative route table: (HTTP method, path pattern, handler function of :mod:`.responses`).

Patterns match the path after ``/v2/``. Segments never contain ``/`` or ``:``, so the colon
verbs (``:run``, ``:cancel``, ``:wait``) are matched explicitly instead of by a path converter.
"""

from __future__ import annotations

import re

from . import responses

_SEG = r"[^/:]+"
_LOC = rf"projects/{_SEG}/locations/{_SEG}"
_JOB = rf"{_LOC}/jobs/{_SEG}"
_EXEC = rf"{_JOB}/executions/{_SEG}"
_OP = rf"{_LOC}/operations/{_SEG}"

ROUTES = [
    ("POST", rf"(?P<parent>{_LOC})/jobs", responses.create_job),
    ("GET", rf"(?P<parent>{_LOC})/jobs", responses.list_jobs),
    ("GET", rf"(?P<name>{_JOB})", responses.get_job),
    ("PATCH", rf"(?P<name>{_JOB})", responses.update_job),
    ("DELETE", rf"(?P<name>{_JOB})", responses.delete_job),
    ("POST", rf"(?P<name>{_JOB}):run", responses.run_job),
    ("GET", rf"(?P<parent>{_JOB})/executions", responses.list_executions),
    ("GET", rf"(?P<name>{_EXEC})", responses.get_execution),
    ("DELETE", rf"(?P<name>{_EXEC})", responses.delete_execution),
    ("POST", rf"(?P<name>{_EXEC}):cancel", responses.cancel_execution),
    ("GET", rf"(?P<parent>{_EXEC})/tasks", responses.list_tasks),
    ("GET", rf"(?P<name>{_EXEC}/tasks/{_SEG})", responses.get_task),
    ("GET", rf"(?P<name>{_LOC})/operations", responses.list_operations),
    ("GET", rf"(?P<name>{_OP})", responses.get_operation),
    ("POST", rf"(?P<name>{_OP}):wait", responses.wait_operation),
    ("DELETE", rf"(?P<name>{_OP})", responses.delete_operation),
]

COMPILED = [(method, re.compile(pattern + r"/?$"), handler) for method, pattern, handler in ROUTES]


def match(method: str, path: str):
    """``(handler, groups)`` for a ``/v2/``-relative path, or ``None``; ``handler`` is a function
    of :mod:`.responses` taking a :class:`~.responses.Request`.

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
