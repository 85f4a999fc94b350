"""The operators' arguments as given or rendered from templates: parsed and checked, before any API call.

Pure: no I/O. Each check raises one ``ValueError`` naming the argument as the user wrote it and
the allowed values.

- :func:`parse_execute_arguments` (with :func:`parse_count`, :func:`parse_seconds`,
  :func:`parse_flag`): the execute operator's numbers, flags and overrides (a template renders to
  a string).
- :data:`SPEC_FIELDS`, :func:`spec_default`, :func:`coerce_spec_value`, :func:`is_templated`,
  :func:`with_spec_parameters`: the deploy operator takes every
  :class:`~airflow_gpu_resilience.job_spec.GpuJobSpec` field as a keyword argument.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import typing
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from airflow_gpu_resilience.cloud_run_rules import (
    validate_bucket_name,
    validate_job_name,
    validate_project_id,
    validate_region,
)
from airflow_gpu_resilience.job_spec import GpuJobSpec
from airflow_gpu_resilience.overrides import check_overrides

__all__ = [
    "SPEC_FIELDS",
    "coerce_spec_value",
    "is_templated",
    "parse_count",
    "parse_execute_arguments",
    "parse_exit_codes",
    "parse_flag",
    "parse_seconds",
    "spec_default",
    "with_spec_parameters",
]


def parse_count(name: str, value: int | str) -> int:
    """A non-negative integer, given or rendered from a template (``"3"`` -> 3).

    :raises ValueError: naming ``name`` unless it is an integer >= 0 (a bool is refused too).
    """
    if isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be an integer >= 0")
    return value


def parse_seconds(name: str, value: float | str) -> float:
    """A number of seconds, given or rendered from a template.

    :raises ValueError: naming ``name`` unless it is a finite number > 0 (a bool is refused too).
    """
    try:
        seconds = float("nan") if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{name}={value!r} must be a positive, finite number of seconds")
    return seconds


def parse_flag(name: str, value: bool | str) -> bool:
    """A bool, given or rendered from a template (``"true"``/``"false"``, any case).

    :raises ValueError: naming ``name`` for any other value.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"{name}={value!r} must be true or false")


def parse_exit_codes(name: str, value: Iterable[int]) -> list[int]:
    """A collection of process exit codes, sorted.

    A process's exit status is 8 bits (0-255, POSIX ``wait``), and 0 is success, so each code is
    an integer from 1 to 255.

    :raises ValueError: naming ``name`` for a string, a mapping, a non-collection, or a code that
        is not an integer from 1 to 255 (a bool is refused too).
    """
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"{name}={value!r} must be a collection of exit codes (integers from 1 to 255), "
                         "e.g. range(64, 79)")
    codes = list(value)
    bad = [code for code in codes if isinstance(code, bool) or not isinstance(code, int) or not 1 <= code <= 255]
    if bad:
        raise ValueError(f"{name}={value!r} holds {bad[0]!r}: exit codes are integers from 1 to 255 (0 is "
                         "success), e.g. range(64, 79)")
    return sorted(set(codes))


def _checked(validate: Any, optional: bool = False) -> Any:
    """A parser that checks a name with ``validate(value, param=name)`` and returns the value unchanged
    (``None``, and with ``optional`` ``""`` too, pass unchecked)."""

    def parse(name: str, value: Any) -> Any:
        if not (optional and value in (None, "")):
            validate(value, param=name)
        return value

    return parse


def _optional_seconds(name: str, value: float | str | None) -> float | None:
    return None if value is None else parse_seconds(name, value)


def _overrides(name: str, value: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    check_overrides(value)
    return value


#: The execute operator's arguments checked before any API call, in the order they are checked,
#: with their parsers (each ``(name, value) -> parsed value``, raising ``ValueError``).
_EXECUTE_PARSERS = {
    "job_name": _checked(validate_job_name),
    "project_id": _checked(validate_project_id, optional=True),
    "region": _checked(validate_region),
    "checkpoint_bucket": _checked(validate_bucket_name, optional=True),
    "fatal_exit_codes": parse_exit_codes,
    "max_preemption_reruns": parse_count,
    "max_reruns_without_progress": parse_count,
    "max_total_reruns": parse_count,
    "poll_interval": parse_seconds,
    "log_container_output": parse_flag,
    "overrides": _overrides,
    "timeout": _optional_seconds,
    "wait_timeout": _optional_seconds,
    "progress_read_timeout": parse_seconds,
}


def parse_execute_arguments(values: Mapping[str, Any], templated: Collection[str] = ()) -> dict[str, Any]:
    """The execute operator's arguments, checked and parsed: one ``ValueError`` for the first bad one.

    Checked: ``job_name`` (a Cloud Run job name), ``project_id`` (a project id, or ``None``: the
    connection's), ``region`` (a Cloud Run region), ``checkpoint_bucket`` (a bucket name, or
    ``None``), ``fatal_exit_codes`` (:func:`parse_exit_codes`; the rules and their sources are in
    :mod:`~airflow_gpu_resilience.cloud_run_rules`), ``max_preemption_reruns``,
    ``max_reruns_without_progress`` and ``max_total_reruns``
    (integers >= 0, :func:`parse_count`), ``poll_interval`` (seconds > 0, :func:`parse_seconds`),
    ``log_container_output`` (:func:`parse_flag`), ``overrides``
    (:func:`~airflow_gpu_resilience.overrides.check_overrides`), ``timeout`` and ``wait_timeout``
    (seconds > 0, or ``None``), ``progress_read_timeout`` (seconds > 0).

    :param values: argument name -> value, as given (when the DAG is parsed) or rendered (at
        execute); the arguments above that it holds are checked.
    :param templated: names whose value may not be final yet (when the DAG is parsed: the template
        fields): one that holds a Jinja template, or is not plain data (an ``XComArg``), is left out
        then, to be checked once rendered (default none).
    :return: argument name -> parsed value, for every argument checked.
    :raises ValueError: naming the argument and the allowed values.
    """
    parsed = {}
    for name, parse in _EXECUTE_PARSERS.items():
        if name in values and not (name in templated and not _final(values[name])):
            parsed[name] = parse(name, values[name])
    return parsed


def _final(value: Any) -> bool:
    """Whether a template field's value is final as given: plain data without a Jinja template."""
    plain = (str, bytes, int, float, type(None), list, tuple, dict, set, frozenset, range)
    return isinstance(value, plain) and not is_templated(value)


#: The :class:`GpuJobSpec` fields the deploy operator takes as keyword arguments: every field but
#: ``name`` (the operator's ``job_name``), with the spec's own defaults.
SPEC_FIELDS: tuple[dataclasses.Field, ...] = tuple(f for f in dataclasses.fields(GpuJobSpec) if f.name != "name")
_SPEC_TYPES = typing.get_type_hints(GpuJobSpec)


def spec_default(spec_field: dataclasses.Field) -> Any:
    """The field's default (a fresh one for a factory), or ``inspect.Parameter.empty`` when required."""
    if spec_field.default_factory is not dataclasses.MISSING:
        return spec_field.default_factory()
    if spec_field.default is not dataclasses.MISSING:
        return spec_field.default
    return inspect.Parameter.empty


def is_templated(value: Any) -> bool:
    """Whether ``value`` (a string, or one inside a mapping, list or tuple) holds a Jinja template
    (``{{`` or ``{%``), so that it can only be checked once rendered."""
    if isinstance(value, str):
        return "{{" in value or "{%" in value
    if isinstance(value, Mapping):
        return any(is_templated(k) or is_templated(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(is_templated(v) for v in value)
    return False


def coerce_spec_value(name: str, value: Any) -> Any:
    """A rendered template string in the spec field's type (``"3"`` -> 3, ``"False"`` -> False, ``""`` -> None)."""
    kind = _SPEC_TYPES[name]
    if kind is int and isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip()):
        return int(value)  # ASCII digits only (str.isdigit takes "²" and other scripts' digits)
    if kind is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if kind == (str | None) and value == "":
        return None
    return value


def with_spec_parameters(init: Any) -> inspect.Signature:
    """``init``'s signature with every spec field as a keyword-only parameter before ``**kwargs``.

    Airflow reads an operator's signature to apply ``default_args`` and to check the arguments of
    ``partial()``/``expand()``, so the spec fields must appear in it.
    """
    signature = inspect.signature(init)
    *explicit, variadic = signature.parameters.values()
    spec = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=spec_default(f), annotation=f.type)
        for f in SPEC_FIELDS
    ]
    return signature.replace(parameters=[*explicit, *spec, variadic])
