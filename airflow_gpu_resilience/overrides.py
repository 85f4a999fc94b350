"""The execute operator's ``overrides`` (``RunJobRequest.Overrides``), checked as Cloud Run reads them.

Pure: no I/O. :func:`check_overrides` runs before any API call, so a bad override is one clear
error naming the field as the user wrote it (``overrides['container_overrides'][0]['env'][1]['name']``),
not a refused request or a failed execution. The rules are Cloud Run's, kept in
:mod:`~airflow_gpu_resilience.cloud_run_rules` with their sources: environment variables
(https://cloud.google.com/run/docs/configuring/jobs/environment-variables), tasks per execution
(https://cloud.google.com/run/docs/configuring/jobs/parallelism: 1 to 10000) and the task timeout
(https://cloud.google.com/run/docs/configuring/task-timeout: at most 168 h).

Also the execution's environment as the hook sets and reads it: :data:`START_ID_ENV` (the id
that finds an execution whose RunJob answer was lost), :func:`with_env_overrides`,
:func:`execution_env` and :func:`override_timeout_seconds`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from google.cloud import run_v2

from airflow_gpu_resilience.cloud_run_rules import env_var_problem
from airflow_gpu_resilience.job_spec import MAX_TASK_COUNT, MAX_TASK_TIMEOUT_SECONDS, RESERVED_ENV, TASK_TIMEOUT_ENV

__all__ = [
    "OVERRIDE_FIELDS", "OVERRIDE_RESERVED_ENV", "START_ID_ENV", "check_overrides", "execution_env",
    "override_timeout_seconds", "with_env_overrides",
]

#: The fields of ``RunJobRequest.Overrides`` (Cloud Run Admin API v2).
OVERRIDE_FIELDS = ("container_overrides", "task_count", "timeout")
#: Env var names an override may not set: Cloud Run's own, and the task timeout the worker's
#: deadline follows (set from ``overrides['timeout']`` by the hook, else the job's).
OVERRIDE_RESERVED_ENV = RESERVED_ENV | {TASK_TIMEOUT_ENV}


def check_overrides(overrides: Mapping[str, Any] | None) -> None:
    """Check the execute operator's ``overrides`` as Cloud Run would read them, before any API call.

    :param overrides: ``RunJobRequest.Overrides`` in dict form: ``container_overrides`` (a list of
        ``{name, args, env, clear_args}``), ``task_count`` (an integer from 1 to 10000, Cloud Run's
        most tasks per execution; 0 keeps the job's) and ``timeout`` (``"20s"``, ``{"seconds": 20}``
        or a ``timedelta``: whole seconds from 1 to 604800, the job spec's ``task_timeout`` range),
        or ``None``. A container's ``name`` is empty (the job's first container) or a DNS label; an
        env var's name is not empty and holds no ``=`` or NUL, and is not
        ``CLOUD_RUN_*`` (Cloud Run's) or ``TASK_TIMEOUT_SECONDS`` (set from ``timeout``); its value
        and every arg hold no NUL (a process's environment and arguments cannot carry one).
    :raises ValueError: one error naming ``overrides``, the field and the allowed values.
    """
    if overrides is None:
        return
    if not isinstance(overrides, Mapping):
        raise ValueError(f"overrides={overrides!r} must be a dict with the fields {', '.join(OVERRIDE_FIELDS)} "
                         "(RunJobRequest.Overrides), or None")
    unknown = sorted(str(key) for key in overrides if key not in OVERRIDE_FIELDS)
    if unknown:
        raise ValueError(f"overrides has unknown field(s) {', '.join(unknown)}; allowed: {', '.join(OVERRIDE_FIELDS)}")
    for key in OVERRIDE_FIELDS:
        if key not in overrides:
            continue
        try:
            parsed = run_v2.RunJobRequest.Overrides(**{key: overrides[key]})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"overrides[{key!r}]={overrides[key]!r} is not valid: {exc}") from None
        if key == "task_count" and not (parsed.task_count == 0 or 1 <= parsed.task_count <= MAX_TASK_COUNT):
            raise ValueError(f"overrides['task_count']={overrides[key]!r} must be an integer from 1 to "
                             f"{MAX_TASK_COUNT} (Cloud Run's most tasks per execution), or 0 to keep the job's")
        if key == "timeout" and overrides[key] not in (None, ""):
            seconds = parsed.timeout.total_seconds()
            if not (seconds.is_integer() and 1 <= seconds <= MAX_TASK_TIMEOUT_SECONDS):
                raise ValueError(f"overrides['timeout']={overrides[key]!r} must be a whole number of seconds from 1 to "
                                 f"{MAX_TASK_TIMEOUT_SECONDS} (168 h), e.g. \"3600s\", as the job's task_timeout")
        if key == "container_overrides":
            for index, container in enumerate(parsed.container_overrides):
                _check_container(f"overrides['container_overrides'][{index}]", container)


#: A container name: Cloud Run's ``Container.name`` is a DNS label (RFC 1123), at most 63 characters
#: (https://cloud.google.com/run/docs/reference/rest/v2/Container).
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _check_container(where: str, container: run_v2.RunJobRequest.Overrides.ContainerOverride) -> None:
    """Check one container override's name, env and args; ``where`` is how the user wrote it.

    :raises ValueError: naming the container's ``name``, the env var's ``name`` or ``value``, or the
        arg, and the rule.
    """
    if container.name and not _DNS_LABEL.fullmatch(container.name):
        raise ValueError(f"{where}['name']={container.name!r} is not a container name: a DNS label (RFC 1123) of 1 "
                         "to 63 lowercase letters, digits and '-', starting and ending with a letter or digit, "
                         "as Cloud Run names containers; or empty for the job's first container")
    taken = sorted({e.name for e in container.env} & OVERRIDE_RESERVED_ENV)
    if taken:
        raise ValueError(f"{where} sets {', '.join(taken)}: reserved (Cloud Run sets CLOUD_RUN_*; "
                         f"{TASK_TIMEOUT_ENV} follows overrides['timeout'] or the job's task_timeout)")
    for index, env in enumerate(container.env):
        problem = env_var_problem(env.name, env.value)
        if problem:
            field = "name" if problem.startswith("name") else "value"
            raise ValueError(f"{where}['env'][{index}]['{field}']: {problem} (Cloud Run's environment variable "
                             "rules: a name is not empty and holds no '=' or NUL; a value holds no NUL)")
    for index, arg in enumerate(container.args):
        if "\x00" in arg:
            raise ValueError(f"{where}['args'][{index}]={arg!r} must not contain NUL (a process argument cannot "
                             "carry one)")


#: Container env var holding the id of the RunJob request that started an execution.
START_ID_ENV = "AIRFLOW_GPU_RESILIENCE_START_ID"

def execution_env(execution: run_v2.Execution) -> dict[str, str]:
    """The env vars of an execution's first container (the job's, with RunJob overrides applied).

    :param execution: the execution as GetExecution or ListExecutions returns it.
    :return: env var names to values (``value_source`` secrets are left out).
    """
    containers = execution.template.containers
    return {e.name: e.value for e in containers[0].env} if containers else {}


def with_env_overrides(overrides: dict | None, env: dict[str, str]) -> dict:
    """``overrides`` (``RunJobRequest.Overrides`` dict form) with ``env`` added to the first container.

    Pure: the argument is not changed. A name already set there is replaced.

    :param overrides: the user's overrides, or ``None``.
    :param env: env var names to values.
    :return: a new overrides dict.
    """
    result = dict(overrides or {})
    containers = [dict(c) for c in result.get("container_overrides", [])] or [{}]
    kept = [e for e in containers[0].get("env", []) if e.get("name") not in env]
    containers[0]["env"] = kept + [{"name": k, "value": v} for k, v in env.items()]
    result["container_overrides"] = containers
    return result


def override_timeout_seconds(overrides: Mapping[str, Any] | None) -> float | None:
    """The per-execution task timeout of ``RunJobRequest.Overrides`` in dict form, in seconds.

    :param overrides: the overrides (``timeout`` as ``"20s"``, ``{"seconds": 20}`` or a
        ``timedelta``), or ``None``.
    :return: the timeout, or ``None`` when the overrides do not set one.
    """
    if not overrides or overrides.get("timeout") in (None, ""):
        return None
    return run_v2.RunJobRequest.Overrides(timeout=overrides["timeout"]).timeout.total_seconds()
