"""The execute operator's ``overrides``: one clear error, naming the field, before any API call."""

from __future__ import annotations

import datetime

import pytest

from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuExecuteJobOperator
from airflow_gpu_resilience.overrides import check_overrides


@pytest.mark.parametrize("overrides", [
    None,
    {},
    {"timeout": "20s"},
    {"timeout": {"seconds": 20}},
    {"timeout": datetime.timedelta(minutes=5)},
    {"timeout": "1s"},
    {"timeout": "604800s"},  # 168 h, the job spec's task_timeout maximum
    {"timeout": None},
    {"task_count": 4},
    {"task_count": 10000},  # Cloud Run's most tasks per execution
    {"task_count": 0},  # unset: the job's task_count
    {"container_overrides": [{"env": [{"name": "S", "value_source": {"secret_key_ref": {"secret": "s"}}}]}]},
    {"container_overrides": [{"env": [{"name": "A", "value": ""}]}]},
    {"container_overrides": [{"args": ["--steps", "10"], "env": [{"name": "A", "value": "1"}]}]},
    {"container_overrides": [{"name": "worker", "args": ["train"]}]},
    {"container_overrides": [{"name": "a" * 63}, {"name": "0-sidecar-1"}]},
])
def test_valid_overrides_pass(overrides):
    check_overrides(overrides)


@pytest.mark.parametrize(("overrides", "message"), [
    ([{"timeout": "20s"}], r"^overrides=\[.*\] must be a dict with the fields container_overrides, task_count, timeout"),
    ({"timeout": "abc"}, r"^overrides\['timeout'\]='abc' is not valid: "),
    ({"timeout": ""}, r"^overrides\['timeout'\]='' is not valid: "),
    ({"timeout": "0s"}, r"^overrides\['timeout'\]='0s' must be a whole number of seconds from 1 to 604800"),
    ({"timeout": "-30s"}, r"^overrides\['timeout'\]='-30s' must be a whole number of seconds from 1 to 604800"),
    ({"timeout": "604801s"}, r"^overrides\['timeout'\]='604801s' must be a whole number of seconds from 1 to 604800"),
    ({"timeout": datetime.timedelta(days=30)}, r"^overrides\['timeout'\]=datetime.timedelta\(days=30\) must be a whole"),
    ({"timeout": "0.5s"}, r"^overrides\['timeout'\]='0.5s' must be a whole number of seconds"),
    ({"timeout": {"seconds": 100000, "nanos": 500000000}}, r"^overrides\['timeout'\]=.* must be a whole number"),
    ({"container_overrides": [{"env": [{"name": "TASK_TIMEOUT_SECONDS", "value": "60"}]}]},
     r"^overrides\['container_overrides'\]\[0\] sets TASK_TIMEOUT_SECONDS: reserved"),
    ({"container_overrides": [{"env": [{"name": "A", "value": "1"}]}, {"env": [{"name": "CLOUD_RUN_TASK_INDEX", "value": "7"}]}]},
     r"^overrides\['container_overrides'\]\[1\] sets CLOUD_RUN_TASK_INDEX: reserved"),
    ({"timeout": 20}, r"^overrides\['timeout'\]=20 is not valid: "),
    ({"task_count": -1}, r"^overrides\['task_count'\]=-1 must be an integer from 1 to 10000 \(Cloud Run's most"),
    ({"task_count": 10001}, r"^overrides\['task_count'\]=10001 must be an integer from 1 to 10000 .*or 0 to keep"),
    ({"container_overrides": [{"env": [{"name": "A", "value": "1"}, {"name": "A=B", "value": "1"}]}]},
     r"^overrides\['container_overrides'\]\[0\]\['env'\]\[1\]\['name'\]: name 'A=B' must not contain '=' or NUL"),
    ({"container_overrides": [{}, {"env": [{"name": "", "value": "1"}]}]},
     r"^overrides\['container_overrides'\]\[1\]\['env'\]\[0\]\['name'\]: name '' must be a non-empty string"),
    ({"container_overrides": [{"env": [{"name": "A\x00", "value": "1"}]}]},
     r"^overrides\['container_overrides'\]\[0\]\['env'\]\[0\]\['name'\]: .* must not contain '=' or NUL"),
    ({"container_overrides": [{"env": [{"name": "A", "value": "a\x00b"}]}]},
     r"^overrides\['container_overrides'\]\[0\]\['env'\]\[0\]\['value'\]: value of 'A' must not contain NUL"),
    ({"container_overrides": [{"args": ["--steps", "1\x00"]}]},
     r"^overrides\['container_overrides'\]\[0\]\['args'\]\[1\]='1\\x00' must not contain NUL"),
    ({"container_overrides": [{"name": "work\x00er"}]},
     r"^overrides\['container_overrides'\]\[0\]\['name'\]='work\\x00er' is not a container name: a DNS label"),
    ({"container_overrides": [{"name": "Worker"}]}, r"^overrides\['container_overrides'\]\[0\]\['name'\]='Worker' is not a"),
    ({"container_overrides": [{}, {"name": "-w"}]}, r"^overrides\['container_overrides'\]\[1\]\['name'\]='-w' is not a"),
    ({"container_overrides": [{"name": "a" * 64}]}, r"^overrides\['container_overrides'\]\[0\]\['name'\]='a{64}' is not a"),
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


def test_a_timeout_override_sets_the_workers_deadline_through_the_hook(monkeypatch):
    """``start_execution`` (the operator's way to start, and a hook user's) gives the container
    ``TASK_TIMEOUT_SECONDS`` equal to the override, as a whole number."""
    from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook

    sent = []
    hook = CloudRunGpuHook.__new__(CloudRunGpuHook)
    monkeypatch.setattr(hook, "run_job", lambda **kwargs: (sent.append(kwargs["overrides"]), ("op", "ex"))[1],
                        raising=False)
    assert CloudRunGpuHook.start_execution.__wrapped__(hook, job_name="j", region="r", project_id="p",
                                                      overrides={"timeout": "600s"}) == "ex"
    env = {e["name"]: e["value"] for e in sent[0]["container_overrides"][0]["env"]}
    assert env["TASK_TIMEOUT_SECONDS"] == "600"
