"""The declarative route table: (HTTP method, path pattern, transcoding function of
:mod:`.responses`, the method of :data:`~.rpcs.RPCS` it calls), after Google's HTTP rules.

Patterns match the path after ``/v2/``. Segments never contain ``/``, and none but the project
contains ``:``, so the colon verbs (``:run``, ``:cancel``, ``:wait``) are matched explicitly
instead of by a path converter. The project segment may hold one colon: a domain-scoped project
id (``example.com:my-project``), which the clients put in the path as it is.
"""

from __future__ import annotations

import re

from . import responses
from .rpcs import EXECUTIONS, JOBS, OPERATIONS, RPCS, TASKS

_SEG = r"[^/:]+"
_PROJECT = rf"{_SEG}(?::{_SEG})?"
_LOC = rf"projects/{_PROJECT}/locations/{_SEG}"
_JOB = rf"{_LOC}/jobs/{_SEG}"
_EXEC = rf"{_JOB}/executions/{_SEG}"
_OP = rf"{_LOC}/operations/{_SEG}"

ROUTES = [
    ("POST", rf"(?P<parent>{_LOC})/jobs", responses.create_job, f"/{JOBS}/CreateJob"),
    ("GET", rf"(?P<parent>{_LOC})/jobs", responses.list_jobs, f"/{JOBS}/ListJobs"),
    ("GET", rf"(?P<name>{_JOB})", responses.get_job, f"/{JOBS}/GetJob"),
    ("PATCH", rf"(?P<name>{_JOB})", responses.update_job, f"/{JOBS}/UpdateJob"),
    ("DELETE", rf"(?P<name>{_JOB})", responses.delete_job, f"/{JOBS}/DeleteJob"),
    ("POST", rf"(?P<name>{_JOB}):run", responses.run_job, f"/{JOBS}/RunJob"),
    ("GET", rf"(?P<parent>{_JOB})/executions", responses.list_executions, f"/{EXECUTIONS}/ListExecutions"),
    ("GET", rf"(?P<name>{_EXEC})", responses.get_execution, f"/{EXECUTIONS}/GetExecution"),
    ("DELETE", rf"(?P<name>{_EXEC})", responses.delete_execution, f"/{EXECUTIONS}/DeleteExecution"),
    ("POST", rf"(?P<name>{_EXEC}):cancel", responses.cancel_execution, f"/{EXECUTIONS}/CancelExecution"),
    ("GET", rf"(?P<parent>{_EXEC})/tasks", responses.list_tasks, f"/{TASKS}/ListTasks"),
    ("GET", rf"(?P<name>{_EXEC}/tasks/{_SEG})", responses.get_task, f"/{TASKS}/GetTask"),
    ("GET", rf"(?P<name>{_LOC})/operations", responses.list_operations, f"/{OPERATIONS}/ListOperations"),
    ("GET", rf"(?P<name>{_OP})", responses.get_operation, f"/{OPERATIONS}/GetOperation"),
    ("POST", rf"(?P<name>{_OP}):wait", responses.wait_operation, f"/{OPERATIONS}/WaitOperation"),
    ("DELETE", rf"(?P<name>{_OP})", responses.delete_operation, f"/{OPERATIONS}/DeleteOperation"),
]

COMPILED = [(method, re.compile(pattern + r"/?$"), builder, RPCS[rpc]) for method, pattern, builder, rpc in ROUTES]


def match(method: str, path: str):
    """``(builder, groups, rpc)`` for a ``/v2/``-relative path, or ``None``: ``builder`` is a
    function of :mod:`.responses` that makes the request message of ``rpc`` (an
    :class:`~.rpcs.Rpc`) from a :class:`~.responses.Request`.

    :param method: HTTP method, upper case.
    :param path: the decoded path without the ``/v2/`` prefix.
    """
    for route_method, pattern, builder, rpc in COMPILED:
        found = pattern.match(path)
        if found and route_method == method:
            return builder, found.groupdict(), rpc
    return None


def path_exists(path: str) -> bool:
    """Whether any route matches ``path`` (to tell 405 from 404)."""
    return any(pattern.match(path) for _, pattern, _, _ in COMPILED)
