"""The Admin API request quota and the request counters (:mod:`cloud_run_emulator.quota`).

Black-box: the real run_v2 clients on both transports, and raw HTTP for the exact JSON, against an
emulator with a read quota of 5 and a write quota of 3 per minute. Each test works in a project of
its own, so the tests' windows and counters never mix. Then table tests of the pure parts: which
method is a read or a write, the scope a request is charged to, the sliding window.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import grpc
import pytest
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import run_v2
from google.cloud.run_v2.services.jobs.transports import JobsGrpcTransport
from google.longrunning import operations_pb2

from cloud_run_emulator import __main__ as cli
from cloud_run_emulator.exceptions import ResourceExhausted
from cloud_run_emulator.process import EmulatorProcess, post_json
from cloud_run_emulator.quota import (
    KINDS, NO_SCOPE, READ, WRITE, QuotaSettings, RequestQuota, project_number, scope_of)
from cloud_run_emulator.rpcs import RPCS

from .conftest import make_job

READS, WRITES = 5, 3
REGION, OTHER_REGION = "us-central1", "europe-west4"


@pytest.fixture(scope="module")
def limited(tmp_path_factory, images_file):
    with EmulatorProcess(tmp_path_factory.mktemp("quota"), images_file=images_file, grace_seconds=1.0,
                         read_quota_per_minute=READS, write_quota_per_minute=WRITES) as emu:
        yield emu


@pytest.fixture(scope="module")
def clients(limited):
    """``(rest, grpc)`` JobsClients on the limited emulator."""
    channel = grpc.insecure_channel(limited.grpc_endpoint)
    rest = run_v2.JobsClient(credentials=AnonymousCredentials(), transport="rest",
                             client_options={"api_endpoint": limited.endpoint})
    yield rest, run_v2.JobsClient(transport=JobsGrpcTransport(channel=channel))
    channel.close()


@pytest.fixture
def project():
    return f"quota-{uuid.uuid4().hex[:10]}"


def _http(url: str, method: str = "GET", body: bytes | None = None) -> tuple:
    """``(status, decoded JSON)`` of one raw HTTP request."""
    request = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _expected_error(kind: str, project: str, region: str, limit: int) -> dict:
    quota, number = KINDS[kind], project_number(project)
    return {"error": {
        "code": 429, "status": "RESOURCE_EXHAUSTED",
        "message": f"Quota exceeded for quota metric '{quota.metric}' and limit '{quota.limit}' of service "
                   f"'run.googleapis.com' for consumer 'project_number:{number}'.",
        "details": [
            {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "RATE_LIMIT_EXCEEDED",
             "domain": "googleapis.com",
             "metadata": {"service": "run.googleapis.com", "consumer": f"projects/{number}",
                          "quota_metric": quota.metric_id, "quota_limit": quota.limit_id,
                          "quota_limit_value": str(limit), "quota_location": region,
                          "quota_unit": "1/min/{project}/{region}"}},
            {"@type": "type.googleapis.com/google.rpc.Help", "links": [
                {"description": "Request a higher quota limit.",
                 "url": "https://cloud.google.com/docs/quotas/help/request_increase"}]},
        ]}}


def test_the_sixth_read_gets_429_on_both_transports_and_writes_and_regions_are_apart(limited, clients, project):
    rest, grpc_jobs = clients
    parent = f"projects/{project}/locations/{REGION}"
    for client in (rest, grpc_jobs, rest, grpc_jobs):
        assert list(client.list_jobs(parent=parent)) == []
    with pytest.raises(gexc.NotFound):  # a read that fails is still a read
        grpc_jobs.get_job(name=f"{parent}/jobs/missing")
    status, body = _http(f"{limited.endpoint}/v2/{parent}/jobs")  # the sixth
    expected = _expected_error(READ, project, REGION, READS)
    assert (status, body) == (429, expected)
    with pytest.raises(gexc.ResourceExhausted) as over_grpc:
        grpc_jobs.list_jobs(parent=parent)
    with pytest.raises(gexc.TooManyRequests) as over_rest:  # REST clients map by the HTTP code
        rest.get_job(name=f"{parent}/jobs/missing")
    message = expected["error"]["message"]
    assert over_grpc.value.message == message and over_rest.value.message.endswith(f": {message}")
    for err in (over_grpc.value, over_rest.value):
        assert (err.reason, err.domain) == ("RATE_LIMIT_EXCEEDED", "googleapis.com")
        assert err.metadata == expected["error"]["details"][0]["metadata"]
    # writes have a quota of their own: the reads' is used up, writes still go through
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    created = rest.create_job(parent=parent, job_id=job_id, job=make_job("local/true"))
    assert created.operation.done
    job_name = f"{parent}/jobs/{job_id}"
    grpc_jobs.update_job(job=run_v2.Job(name=job_name, template=make_job("local/true").template))
    grpc_jobs.delete_job(name=job_name)
    with pytest.raises(gexc.ResourceExhausted) as write_over:  # the fourth write
        grpc_jobs.create_job(parent=parent, job_id=job_id, job=make_job("local/true"))
    assert write_over.value.message == _expected_error(WRITE, project, REGION, WRITES)["error"]["message"]
    # another region of the same project has quotas of its own
    assert list(rest.list_jobs(parent=f"projects/{project}/locations/{OTHER_REGION}")) == []
    assert limited.requests(project=project) == {
        "total": {"requests": 13, "quotaExceeded": 4},
        "methods": {"CreateJob": {"requests": 2, "quotaExceeded": 1}, "DeleteJob": {"requests": 1, "quotaExceeded": 0},
                    "GetJob": {"requests": 2, "quotaExceeded": 1}, "ListJobs": {"requests": 7, "quotaExceeded": 2},
                    "UpdateJob": {"requests": 1, "quotaExceeded": 0}},
        "locations": {
            f"projects/{project}/locations/{OTHER_REGION}": {"ListJobs": {"requests": 1, "quotaExceeded": 0}},
            parent: {"CreateJob": {"requests": 2, "quotaExceeded": 1}, "DeleteJob": {"requests": 1, "quotaExceeded": 0},
                     "GetJob": {"requests": 2, "quotaExceeded": 1}, "ListJobs": {"requests": 6, "quotaExceeded": 2},
                     "UpdateJob": {"requests": 1, "quotaExceeded": 0}}}}
    usage = _http(f"{limited.endpoint}/_emulator/quota")[1]["usage"]
    assert usage[parent] == {"read": READS, "write": WRITES}
    assert usage[f"projects/{project}/locations/{OTHER_REGION}"] == {"read": 1, "write": 0}


def test_operations_are_charged_to_the_region_in_their_name(limited, clients, project):
    rest, grpc_jobs = clients
    parent = f"projects/{project}/locations/{REGION}"
    operation = rest.create_job(parent=parent, job_id="op-job", job=make_job("local/true")).operation.name
    assert operation.startswith(f"{parent}/operations/")
    for _ in range(READS):
        assert grpc_jobs.get_operation(request={"name": operation}).done
    with pytest.raises(gexc.ResourceExhausted, match="'Read requests per minute per region'"):
        grpc_jobs.wait_operation(request={"name": operation, "timeout": {"seconds": 1}})
    assert _http(f"{limited.endpoint}/v2/{operation}")[0] == 429
    counts = limited.requests(project=project, region=REGION)["methods"]
    assert counts == {"CreateJob": {"requests": 1, "quotaExceeded": 0},
                      "GetOperation": {"requests": READS + 1, "quotaExceeded": 1},
                      "WaitOperation": {"requests": 1, "quotaExceeded": 1}}


def test_quota_changes_at_runtime_and_zero_turns_it_off(limited, clients, project):
    rest, _ = clients
    parent = f"projects/{project}/locations/{REGION}"
    try:
        status, body = _http(f"{limited.endpoint}/_emulator/quota", "POST", b'{"readRequestsPerMinute": 0}')
        assert status == 200 and body["readRequestsPerMinute"] == 0 and body["writeRequestsPerMinute"] == WRITES
        for _ in range(3 * READS):
            assert list(rest.list_jobs(parent=parent)) == []
        status, body = _http(f"{limited.endpoint}/_emulator/quota", "POST", b'{"readRequestsPerMinute": 2}')
        assert (status, body["readRequestsPerMinute"], body["windowSeconds"]) == (200, 2, 60.0)
        list(rest.list_jobs(parent=parent)), list(rest.list_jobs(parent=parent))  # off, nothing was charged
        with pytest.raises(gexc.TooManyRequests):
            rest.list_jobs(parent=parent)
    finally:
        post_json(f"{limited.endpoint}/_emulator/quota", {"readRequestsPerMinute": READS})
    assert limited.requests(project=project)["total"] == {"requests": 3 * READS + 3, "quotaExceeded": 1}


@pytest.mark.parametrize(("body", "error"), [
    ({"readRequestsPerMinute": -1}, "readRequestsPerMinute must be an integer >= 0"),
    ({"writeRequestsPerMinute": 1.5}, "writeRequestsPerMinute must be an integer >= 0"),
    ({"writeRequestsPerMinute": True}, "writeRequestsPerMinute must be an integer >= 0"),
    ({"windowSeconds": 0}, "windowSeconds must be a number of seconds > 0 and <= 3600"),
    ({"readRequestsPerMinute": 1, "burst": 2}, "unknown settings ['burst']; known: "),
])
def test_bad_quota_settings_are_one_error_naming_the_key_and_change_nothing(limited, body, error):
    status, answer = _http(f"{limited.endpoint}/_emulator/quota", "POST", json.dumps(body).encode())
    assert status == 400 and answer["error"]["status"] == "INVALID_ARGUMENT" and error in answer["error"]["message"]
    settings = _http(f"{limited.endpoint}/_emulator/quota")[1]
    assert (settings["readRequestsPerMinute"], settings["writeRequestsPerMinute"]) == (READS, WRITES)


def test_admin_endpoints_are_neither_counted_nor_limited_and_counters_reset(limited, project):
    for _ in range(2 * READS):
        assert _http(f"{limited.endpoint}/_emulator/quota")[0] == 200
        assert _http(f"{limited.endpoint}/_emulator/requests?project={project}")[0] == 200
    assert limited.requests(project=project)["total"] == {"requests": 0, "quotaExceeded": 0}
    _http(f"{limited.endpoint}/v2/projects/{project}/locations/{REGION}/jobs")
    assert limited.requests(reset=True)["locations"][f"projects/{project}/locations/{REGION}"] == {
        "ListJobs": {"requests": 1, "quotaExceeded": 0}}
    assert limited.requests() == {"total": {"requests": 0, "quotaExceeded": 0}, "methods": {}, "locations": {}}


@pytest.mark.parametrize(("flag", "value", "error"), [
    ("--read-quota-per-minute", "-5", "--read-quota-per-minute must be an integer >= 0"),
    ("--write-quota-per-minute", "-1", "--write-quota-per-minute must be an integer >= 0"),
    ("--quota-window-seconds", "0", "--quota-window-seconds must be a number of seconds > 0"),
    ("--quota-window-seconds", "nan", "--quota-window-seconds must be a number of seconds > 0"),
])
def test_bad_quota_flags_are_a_usage_error_naming_the_flag(tmp_path, capsys, flag, value, error):
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--data-dir", str(tmp_path / "never"), flag, value])
    assert exited.value.code == 2 and error in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


#: Cloud Run's writes: every method that changes state. Everything else is a read.
WRITE_METHODS = {"CreateJob", "UpdateJob", "DeleteJob", "RunJob", "DeleteExecution", "CancelExecution",
                 "DeleteOperation"}
#: The resource name each method's request carries, relative to projects/P/locations/R.
RESOURCE = {"parent": "", "name": "/jobs/j", "job.name": "/jobs/j"}


@pytest.mark.parametrize("rpc", list(RPCS.values()), ids=lambda rpc: rpc.method)
def test_every_method_is_charged_as_a_read_or_a_write_to_the_region_it_names(rpc):
    quota = RequestQuota(QuotaSettings(reads_per_minute=1, writes_per_minute=1), clock=lambda: 0.0)
    name = "projects/proj-a/locations/asia-east1" + RESOURCE[rpc.resource]
    request = rpc.request(job={"name": name}) if rpc.resource == "job.name" else rpc.request(**{rpc.resource: name})
    assert rpc.resource_name(request) == name
    quota.admit(rpc.method, rpc.mutating, name)
    kind = WRITE if rpc.method in WRITE_METHODS else READ
    other = READ if kind == WRITE else WRITE
    assert quota.describe()["usage"] == {"projects/proj-a/locations/asia-east1": {kind: 1, other: 0}}
    with pytest.raises(ResourceExhausted, match=KINDS[kind].limit):
        quota.admit(rpc.method, rpc.mutating, name)


@pytest.mark.parametrize(("name", "scope"), [
    ("projects/p-1/locations/us-east1", ("p-1", "us-east1")),
    ("projects/p-1/locations/us-east1/jobs/j/executions/e/tasks/e-task0", ("p-1", "us-east1")),
    ("projects/p-1/locations/us-east1/operations/abc", ("p-1", "us-east1")),
    ("projects/123456789012/locations/-", ("123456789012", "-")),
    ("jobs/j", (NO_SCOPE, NO_SCOPE)),
    ("", (NO_SCOPE, NO_SCOPE)),
])
def test_scope_of_a_name(name, scope):
    assert scope_of(name) == scope


def test_the_window_slides_and_a_rejected_request_uses_no_quota():
    now = [0.0]
    quota = RequestQuota(QuotaSettings(reads_per_minute=2, writes_per_minute=0, window_seconds=60.0),
                         clock=lambda: now[0])
    name = "projects/proj-a/locations/us-east1/jobs/j"
    for at, admitted in [(0.0, True), (30.0, True), (59.9, False), (60.0, True), (60.5, False), (89.9, False),
                         (90.0, True), (90.0, False)]:
        now[0] = at
        if admitted:
            quota.admit("GetJob", False, name)
        else:
            with pytest.raises(ResourceExhausted, match="'Read requests per minute per region'"):
                quota.admit("GetJob", False, name)
    for _ in range(100):  # writes are off
        quota.admit("CreateJob", True, name)
    quota.admit("GetJob", False, "not-a-name")  # no region: counted, never limited
    counts = quota.counters()
    assert counts["locations"]["projects/proj-a/locations/us-east1"] == {
        "GetJob": {"requests": 8, "quotaExceeded": 4}, "CreateJob": {"requests": 100, "quotaExceeded": 0}}
    assert counts["locations"]["projects/-/locations/-"] == {"GetJob": {"requests": 1, "quotaExceeded": 0}}
    assert counts["total"] == {"requests": 109, "quotaExceeded": 4}


def test_project_numbers_are_stable_and_numeric_ids_stay():
    assert project_number("123456789012") == "123456789012"
    assert project_number("my-project") == project_number("my-project") != project_number("my-projecu")
    assert len(project_number("my-project")) == 12 and project_number("my-project").isdigit()
