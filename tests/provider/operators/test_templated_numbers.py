"""Rendered template strings of integer fields: ASCII digits only, else the field's own error."""

from __future__ import annotations

import pytest

from airflow_gpu_resilience.operator_args import coerce_spec_value, parse_count


@pytest.mark.parametrize(("value", "expected"), [
    ("3600", 3600),
    (" 3600 ", 3600),
    ("-1", -1),  # left to the spec's range check
    ("²", "²"),  # str.isdigit() says yes, int() says no: left as it is, for the spec to refuse by name
    ("--5", "--5"),
    ("٣٦٠٠", "٣٦٠٠"),  # another script's digits: not a number here
    ("", ""),
])
def test_a_rendered_int_field_is_converted_only_from_ascii_digits(value, expected) -> None:
    assert coerce_spec_value("task_timeout", value) == expected


@pytest.mark.parametrize("value", ["²", "٣", "-3", "3.0", ""])
def test_a_count_names_its_parameter(value) -> None:
    with pytest.raises(ValueError, match=r"^max_reruns=.* must be an integer >= 0$"):
        parse_count("max_reruns", value)


def test_the_spec_refuses_what_was_left_by_name() -> None:
    from airflow_gpu_resilience.job_spec import GpuJobSpec

    with pytest.raises(ValueError, match=r"^task_timeout='²' must be an integer of seconds"):
        GpuJobSpec(name="j", image="i", task_timeout=coerce_spec_value("task_timeout", "²"))
