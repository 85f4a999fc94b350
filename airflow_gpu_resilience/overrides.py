"""The execute operator's ``overrides`` (``RunJobRequest.Overrides``), checked as Cloud Run reads them.

Pure: no I/O. :func:`check_overrides` runs before any API call, so a bad override is one clear
error naming the field, not a failed execution.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.cloud import run_v2

from airflow_gpu_resilience.job_spec import MAX_TASK_TIMEOUT_SECONDS, RESERVED_ENV, TASK_TIMEOUT_ENV

__all__ = ["OVERRIDE_FIELDS", "OVERRIDE_RESERVED_ENV", "check_overrides"]

#: The fields of ``RunJobRequest.Overrides`` (Cloud Run Admin API v2).
OVERRIDE_FIELDS = ("container_overrides", "task_count", "timeout")
#: Env var names an override may not set: Cloud Run's own, and the task timeout the worker's
#: deadline follows (set from ``overrides['timeout']`` by the hook, else the job's).
OVERRIDE_RESERVED_ENV = RESERVED_ENV | {TASK_TIMEOUT_ENV}


def check_overrides(overrides: Mapping[str, Any] | None) -> None:
    """Check the execute operator's ``overrides`` as Cloud Run would read them, before any API call.

    :param overrides: ``RunJobRequest.Overrides`` in dict form: ``container_overrides`` (a list of
        ``{name, args, env, clear_args}``), ``task_count`` (an integer >= 0; 0 keeps the job's) and
        ``timeout`` (``"20s"``, ``{"seconds": 20}`` or a ``timedelta``: whole seconds from 1 to
        604800, the job spec's ``task_timeout`` range), or ``None``. The containers' env may not set
        ``CLOUD_RUN_*`` (Cloud Run's) or ``TASK_TIMEOUT_SECONDS`` (set from ``timeout``).
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
        if key == "task_count" and parsed.task_count < 0:
            raise ValueError(f"overrides['task_count']={overrides[key]!r} must be an integer >= 0")
        if key == "timeout" and overrides[key] not in (None, ""):
            seconds = parsed.timeout.total_seconds()
            if not (seconds.is_integer() and 1 <= seconds <= MAX_TASK_TIMEOUT_SECONDS):
                raise ValueError(f"overrides['timeout']={overrides[key]!r} must be a whole number of seconds from 1 to "
                                 f"{MAX_TASK_TIMEOUT_SECONDS} (168 h), e.g. \"3600s\", as the job's task_timeout")
        if key == "container_overrides":
            for index, container in enumerate(parsed.container_overrides):
                taken = sorted({e.name for e in container.env} & OVERRIDE_RESERVED_ENV)
                if taken:
                    raise ValueError(
                        f"overrides['container_overrides'][{index}] sets {', '.join(taken)}: reserved (Cloud Run sets "
                        f"CLOUD_RUN_*; {TASK_TIMEOUT_ENV} follows overrides['timeout'] or the job's task_timeout)")
