"""RunJob overrides and job templates that Cloud Run refuses: the emulator answers 400
INVALID_ARGUMENT in Google's error shape, through the real ``run_v2`` client, and starts nothing.

Before these checks an env name ``A=B`` or a NUL in a value crashed the execution's supervisor
(``Popen`` refuses them) and left the execution RUNNING for ever, and a ``taskCount`` override of
10,001 was run.
"""

from __future__ import annotations

import pytest
from google.api_core import exceptions as gexc
from google.cloud import run_v2

from .conftest import PARENT, make_job

Overrides = run_v2.RunJobRequest.Overrides


def _status(excinfo) -> str:
    return excinfo.value.response.json()["error"]["status"]


@pytest.mark.parametrize("overrides, field", [
    (Overrides(container_overrides=[{"env": [{"name": "A=B", "value": "1"}]}]),
     r"overrides.container_overrides\[0\].env\[0\].name: 'A=B' is not a valid environment variable name"),
    (Overrides(container_overrides=[{"env": [{"name": "OK", "value": "1"}, {"name": "X", "value": "a\0b"}]}]),
     r"overrides.container_overrides\[0\].env\[1\].value: the value of 'X' must be at most 32768 bytes without NUL"),
    (Overrides(container_overrides=[{"env": [{"name": "", "value": "1"}]}]),
     r"env\[0\].name: '' is not a valid environment variable name"),
    (Overrides(container_overrides=[{"env": [{"name": "CLOUD_RUN_TASK_INDEX", "value": "7"}]}]),
     r"env\[0\].name: 'CLOUD_RUN_TASK_INDEX' is reserved"),
    (Overrides(container_overrides=[{"args": ["ok", "a\0b"]}]), r"overrides.container_overrides\[0\].args\[1\]"),
    (Overrides(task_count=10_001), r"overrides.task_count: must be between 1 and 10000 .*got 10001"),
], ids=["equals-in-name", "nul-in-value", "empty-name", "reserved-name", "nul-in-arg", "10001-tasks"])
def test_run_job_with_an_override_cloud_run_refuses_is_400_and_starts_nothing(jobs, executions, job_id,
                                                                             overrides, field):
    job = jobs.create_job(parent=PARENT, job=make_job("local/exit:latest"), job_id=job_id).result(timeout=10)
    with pytest.raises(gexc.BadRequest, match=field) as err:
        jobs.run_job(request=run_v2.RunJobRequest(name=job.name, overrides=overrides))
    assert _status(err) == "INVALID_ARGUMENT"
    assert list(executions.list_executions(parent=job.name)) == []
    assert jobs.get_job(name=job.name).execution_count == 0


def test_the_largest_task_count_override_is_accepted(jobs, job_id):
    """10,000 is allowed (validate only: nothing runs)."""
    job = jobs.create_job(parent=PARENT, job=make_job("local/exit:latest"), job_id=job_id).result(timeout=10)
    op = jobs.run_job(request=run_v2.RunJobRequest(name=job.name, overrides=Overrides(task_count=10_000),
                                                   validate_only=True))
    assert op.metadata.task_count == 10_000


@pytest.mark.parametrize("env, field", [
    ({"A=B": "1"}, r"job.template.template.containers\[0\].env\[0\].name: 'A=B'"),
    ({"X": "a\0b"}, r"job.template.template.containers\[0\].env\[0\].value"),
    ({"CLOUD_RUN_JOB": "other"}, r"'CLOUD_RUN_JOB' is reserved"),
], ids=["equals-in-name", "nul-in-value", "reserved-name"])
def test_a_job_template_with_such_env_is_refused_at_create_and_update(jobs, job_id, env, field):
    with pytest.raises(gexc.BadRequest, match=field) as err:
        jobs.create_job(parent=PARENT, job=make_job("local/exit:latest", env=env), job_id=job_id).result(timeout=10)
    assert _status(err) == "INVALID_ARGUMENT"
    with pytest.raises(gexc.NotFound):
        jobs.get_job(name=f"{PARENT}/jobs/{job_id}")
    job = jobs.create_job(parent=PARENT, job=make_job("local/exit:latest"), job_id=job_id).result(timeout=10)
    changed = make_job("local/exit:latest", env=env)
    changed.name = job.name
    with pytest.raises(gexc.BadRequest, match=field):
        jobs.update_job(job=changed).result(timeout=10)
    assert jobs.get_job(name=job.name).generation == 1


def test_more_than_1000_env_vars_in_a_container_is_refused(jobs, job_id):
    spec = make_job("local/exit:latest", env={f"V{i}": "x" for i in range(1001)})
    with pytest.raises(gexc.BadRequest, match=r"containers\[0\].env: 1001 variables; at most 1000"):
        jobs.create_job(parent=PARENT, job=spec, job_id=job_id).result(timeout=10)
