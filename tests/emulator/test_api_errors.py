"""Error answers through the real run_v2 REST clients: invalid requests, missing resources and
etag conflicts mapped to google.api_core exceptions with Cloud Run's status, undecodable bodies
and undefined enum numbers answered 400, and the emulator's injected API faults."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from google.api_core import exceptions as gexc
from google.cloud import run_v2

from .conftest import PARENT, create, google_status, make_job


def _with_limits(job: run_v2.Job, limits: dict) -> run_v2.Job:
    job.template.template.containers[0].resources.limits.update(limits)
    return job


def test_errors_map_to_google_exceptions(jobs, executions, job_id, bucket):
    create(jobs, job_id, make_job("local/exit:latest"))
    with pytest.raises(gexc.Conflict, match="already exists") as err:
        create(jobs, job_id, make_job("local/exit:latest"))
    assert google_status(err) == "ALREADY_EXISTS"
    with pytest.raises(gexc.NotFound):
        jobs.get_job(name=f"{PARENT}/jobs/missing")
    with pytest.raises(gexc.NotFound):
        executions.get_execution(name=f"{PARENT}/jobs/{job_id}/executions/{job_id}-zzzzz")
    with pytest.raises(gexc.NotFound):
        jobs.run_job(name=f"{PARENT}/jobs/missing")
    with pytest.raises(gexc.NotFound):
        jobs.get_operation(request={"name": f"{PARENT}/operations/missing"})
    invalid = [
        ("bad-retries", make_job("local/exit:latest", max_retries=11), "max_retries"),
        ("bad-bucket", make_job("local/exit:latest", bucket="no-such-bucket"), r"volumes\[0\].gcs.bucket"),
        ("long-gpu", make_job("local/exit:latest", gpu=True, timeout_s=7200), "launch_stage"),
        ("Bad_Name", make_job("local/exit:latest"), "job_id"),
        ("two-gpus", _with_limits(make_job("local/exit:latest", gpu=True), {"nvidia.com/gpu": "2"}),
         r"resources.limits: 'nvidia.com/gpu' must be"),
        ("l4-2-cpu", _with_limits(make_job("local/exit:latest", gpu=True), {"cpu": "2"}), "resources.limits.cpu"),
        ("too-many-tasks", make_job("local/exit:latest", task_count=10_001), "task_count"),
    ]
    for bad_id, spec, field in invalid:
        with pytest.raises(gexc.BadRequest, match=field) as err:
            create(jobs, bad_id, spec)
        assert google_status(err) == "INVALID_ARGUMENT"
    beta = create(jobs, "long-gpu", make_job("local/exit:latest", gpu=True, timeout_s=7200, launch_stage=3))
    assert beta.launch_stage == 3
    # the rule holds for a RunJob override too: a GA GPU job's execution may not run over 1 h
    ga = create(jobs, "ga-gpu", make_job("local/exit:latest", gpu=True, timeout_s=3600))
    long_run = run_v2.RunJobRequest.Overrides(timeout={"seconds": 7200})
    with pytest.raises(gexc.BadRequest, match="overrides: A GPU task timeout over 1 hour is a Preview feature") as err:
        jobs.run_job(request=run_v2.RunJobRequest(name=ga.name, overrides=long_run))
    assert google_status(err) == "INVALID_ARGUMENT"
    assert not list(executions.list_executions(parent=ga.name))  # nothing started
    with pytest.raises(gexc.BadRequest, match="etag") as err:
        jobs.run_job(request=run_v2.RunJobRequest(name=f"{PARENT}/jobs/{job_id}", etag='"nope"'))
    assert google_status(err) == "FAILED_PRECONDITION"


def test_injected_api_faults(jobs, emulator, job_id):
    from cloud_run_emulator.process import post_json

    create(jobs, job_id, make_job("local/exit:latest"))
    post_json(emulator.endpoint + "/_emulator/faults", {"failNext": 1, "codes": [429]})
    try:
        with pytest.raises(gexc.TooManyRequests):
            jobs.get_job(name=f"{PARENT}/jobs/{job_id}", retry=None)
        assert jobs.get_job(name=f"{PARENT}/jobs/{job_id}").name.endswith(job_id)
    finally:
        post_json(emulator.endpoint + "/_emulator/faults", {})


@pytest.mark.parametrize(("code", "error"), [(500, gexc.InternalServerError), (504, gexc.GatewayTimeout)])
def test_lost_answer_fault_applies_the_request_then_fails_it(jobs, emulator, job_id, code, error):
    from cloud_run_emulator.process import post_json

    post_json(emulator.endpoint + "/_emulator/faults", {"loseAnswerNext": 1, "loseAnswerCode": code})
    try:
        with pytest.raises(error, match="applied but its answer was lost"):
            jobs.create_job(parent=PARENT, job=make_job("local/exit:latest"), job_id=job_id, retry=None)
        assert jobs.get_job(name=f"{PARENT}/jobs/{job_id}").name.endswith(job_id)  # it was applied
        create(jobs, f"{job_id}-b", make_job("local/exit:latest"))  # one request only
    finally:
        post_json(emulator.endpoint + "/_emulator/faults", {})
    for bad in ({"loseAnswerCode": 503}, {"loseAnswerNext": -1}, {"loseAnswerNext": True}):
        answer = post_json(emulator.endpoint + "/_emulator/faults", bad)
        assert answer["error"]["status"] == "INVALID_ARGUMENT" and "loseAnswer" in answer["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (f"/v2/{PARENT}/jobs?jobId=bad-bytes", b"\xff\xfe{"),  # not UTF-8
        (f"/v2/{PARENT}/jobs?jobId=bad-json", b"{\"template\": "),  # torn JSON
        ("/_emulator/faults", b"\xff"),  # the admin API too
    ],
)
def test_undecodable_bodies_are_invalid_argument_not_500(emulator, path: str, body: bytes) -> None:
    request = urllib.request.Request(emulator.endpoint + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request)
    assert err.value.code == 400
    assert json.loads(err.value.read())["error"]["status"] == "INVALID_ARGUMENT"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"launchStage": 999}, "job.launch_stage: invalid value 999"),
        ({"template": {"template": {"executionEnvironment": 77, "containers": [{"image": "local/exit:latest"}]}}},
         "job.template.template.execution_environment: invalid value 77"),
    ],
)
def test_enum_numbers_outside_the_enum_are_invalid_argument(emulator, job_id, body: dict, field: str) -> None:
    """JSON may carry any integer for a proto3 enum; Cloud Run answers an undefined one with 400."""
    request = urllib.request.Request(f"{emulator.endpoint}/v2/{PARENT}/jobs?jobId={job_id}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request)
    error = json.loads(err.value.read())["error"]
    assert err.value.code == 400 and error["status"] == "INVALID_ARGUMENT" and field in error["message"]
