"""The execute operator's ``overrides``: one clear error, naming the field, before any API call."""

from __future__ import annotations

import datetime

import pytest

from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuExecuteJobOperator, check_overrides


@pytest.mark.parametrize("overrides", [
    None,
    {},
    {"timeout": "20s"},
    {"timeout": {"seconds": 20}},
    {"timeout": datetime.timedelta(minutes=5)},
    {"timeout": None},
    {"task_count": 4},
    {"container_overrides": [{"args": ["--steps", "10"], "env": [{"name": "A", "value": "1"}]}]},
])
def test_valid_overrides_pass(overrides):
    check_overrides(overrides)


@pytest.mark.parametrize(("overrides", "message"), [
    ([{"timeout": "20s"}], r"^overrides=\[.*\] must be a dict with the fields container_overrides, task_count, timeout"),
    ({"timeout": "abc"}, r"^overrides\['timeout'\]='abc' is not valid: "),
    ({"timeout": ""}, r"^overrides\['timeout'\]='' is not valid: "),
    ({"timeout": "0s"}, r"^overrides\['timeout'\]='0s' must be a duration > 0"),
    ({"timeout": "-30s"}, r"^overrides\['timeout'\]='-30s' must be a duration > 0"),
    ({"timeout": 20}, r"^overrides\['timeout'\]=20 is not valid: "),
    ({"task_count": -1}, r"^overrides\['task_count'\]=-1 must be an integer >= 0$"),
    ({"task_count": "two"}, r"^overrides\['task_count'\]='two' is not valid: "),
    ({"taskCount": 2, "tiemout": "5s"}, r"^overrides has unknown field\(s\) taskCount, tiemout; allowed: "),
    ({"container_overrides": [{"argz": ["x"]}]}, r"^overrides\['container_overrides'\]=.* is not valid: .*argz"),
])
def test_invalid_overrides_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_overrides(overrides)


def test_execute_refuses_bad_overrides_before_any_api_call():
    """The connection does not exist: any API call (or the hook's project lookup) would fail with
    another error, so this ValueError proves the check came first."""
    op = CloudRunGpuExecuteJobOperator(task_id="e", job_name="j", gcp_conn_id="no_such_connection",
                                       overrides={"timeout": "one hour"})
    with pytest.raises(ValueError, match=r"^overrides\['timeout'\]='one hour' is not valid"):
        op.execute({})
