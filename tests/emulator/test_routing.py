"""Thin HTTP routing test: the route table, colon verbs, and Google's error shape."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from cloud_run_emulator import responses, rpcs, urls
from cloud_run_emulator.app import AppState, create_app
from cloud_run_emulator.backend import Registry
from cloud_run_emulator.faults import ApiFaults
from cloud_run_emulator.images import ImageTable
from cloud_run_emulator.runtime import RuntimeConfig

from .test_backend import FakeGcs

P = "projects/test-project/locations/us-central1"
#: The emulator answers loopback Host values only.
BASE = "http://127.0.0.1:8123"


@pytest.mark.parametrize("method, path, handler, rpc", [
    ("POST", f"{P}/jobs", responses.create_job, "/google.cloud.run.v2.Jobs/CreateJob"),
    ("GET", f"{P}/jobs/j", responses.get_job, "/google.cloud.run.v2.Jobs/GetJob"),
    ("POST", f"{P}/jobs/j:run", responses.run_job, "/google.cloud.run.v2.Jobs/RunJob"),
    ("GET", f"{P}/jobs/-/executions", responses.list_executions, "/google.cloud.run.v2.Executions/ListExecutions"),
    ("POST", f"{P}/jobs/j/executions/e:cancel", responses.cancel_execution,
     "/google.cloud.run.v2.Executions/CancelExecution"),
    ("GET", f"{P}/jobs/j/executions/e/tasks", responses.list_tasks, "/google.cloud.run.v2.Tasks/ListTasks"),
    ("GET", f"{P}/jobs/j/executions/e/tasks/e-task0", responses.get_task, "/google.cloud.run.v2.Tasks/GetTask"),
    ("POST", f"{P}/operations/abc:wait", responses.wait_operation, "/google.longrunning.Operations/WaitOperation"),
    ("DELETE", f"{P}/operations/abc", responses.delete_operation, "/google.longrunning.Operations/DeleteOperation"),
])
def test_route_table(method, path, handler, rpc):
    """Each REST route makes the request message of the method the gRPC server serves at ``rpc``."""
    builder, params, found = urls.match(method, path)
    assert builder == handler and found is rpcs.RPCS[rpc]
    assert isinstance(builder(responses.Request(params, {}, b"")), found.request)


def test_every_method_has_a_rest_route():
    assert sorted(rpc.path for _, _, _, rpc in urls.COMPILED) == sorted(rpcs.RPCS)


def test_http_errors_use_google_shape(tmp_path):
    config = RuntimeConfig(data_dir=tmp_path, images=ImageTable({}, tmp_path), gcs=FakeGcs(tmp_path))
    registry = Registry(config, BASE)
    client = TestClient(create_app(AppState(registry, ApiFaults(), config.gcs, tmp_path)), base_url=BASE)
    missing = client.post(f"/v2/{P}/jobs/nope:run", json={})
    assert missing.status_code == 404
    assert missing.json()["error"]["status"] == "NOT_FOUND" and "nope" in missing.json()["error"]["message"]
    assert client.get(f"/v2/{P}/jobs/j:run").json()["error"]["status"] == "UNIMPLEMENTED"
    assert client.get("/v2/nothing/here").status_code == 404
    bad = client.post(f"/v2/{P}/jobs?jobId=j", content=b'{"notAField": 1}',
                      headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["status"] == "INVALID_ARGUMENT"
    created = client.post(f"/v2/{P}/jobs?jobId=j&$alt=json;enum-encoding=int",
                          json={"template": {"template": {"containers": [{"image": "x"}]}}})
    assert created.json()["done"] is True and created.json()["response"]["launchStage"] == 4
    assert client.get(f"/v2/{P}/jobs/j").json()["launchStage"] == "GA"


def test_transitions_endpoint(tmp_path):
    config = RuntimeConfig(data_dir=tmp_path, images=ImageTable({}, tmp_path), gcs=FakeGcs(tmp_path))
    client = TestClient(create_app(AppState(Registry(config, BASE), ApiFaults(), config.gcs, tmp_path)), base_url=BASE)
    answer = client.post("/_emulator/transitions", json={"taskStartDelaySeconds": 1.5, "preemptionConsumesRetry": False})
    assert answer.json()["taskStartDelaySeconds"] == 1.5 and config.policy.preemption_consumes_retry is False
    assert client.post("/_emulator/transitions", json={"nope": 1}).json()["error"]["status"] == "INVALID_ARGUMENT"
    assert client.post("/_emulator/transitions", json={"preemptionConsumesRetry": "no"}).status_code == 400
    for body, field in [({"graceSeconds": -3}, "graceSeconds"), ({"graceSeconds": "nan"}, "graceSeconds"),
                        ({"taskStartDelaySeconds": -1}, "taskStartDelaySeconds"), ({"gpuQuota": -2}, "gpuQuota"),
                        ({"gpuQuota": 1.5}, "gpuQuota"),
                        ({"taskStartDelaySeconds": 2.5, "graceSeconds": -1}, "graceSeconds")]:
        bad = client.post("/_emulator/transitions", json=body)
        assert bad.status_code == 400 and field in bad.json()["error"]["message"], (body, bad.json())
    # nothing of a refused request was applied, its valid keys included
    assert (config.policy.grace_seconds, config.policy.start_delay_seconds, config.policy.gpu_quota) == (10.0, 1.5, 0)
    assert client.get("/_emulator/health").json()["status"] == "ok"


def test_bad_admin_requests_use_google_shape(tmp_path):
    config = RuntimeConfig(data_dir=tmp_path, images=ImageTable({}, tmp_path), gcs=FakeGcs(tmp_path))
    client = TestClient(create_app(AppState(Registry(config, BASE), ApiFaults(), config.gcs, tmp_path)),
                        raise_server_exceptions=False, base_url=BASE)
    bad = client.post("/_emulator/preempt", json={"execution": f"{P}/jobs/j/executions/e", "taskIndex": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["status"] == "INVALID_ARGUMENT"
    missing = client.post("/_emulator/preempt", json={"execution": f"{P}/jobs/j/executions/e"})
    assert missing.json()["error"]["status"] == "NOT_FOUND"
    execution = f"{P}/jobs/j/executions/e"
    for body, field in [({"taskIndex": True}, "taskIndex"), ({"taskIndex": 0.5}, "taskIndex"),
                        ({"taskIndex": -1}, "taskIndex"), ({"graceSeconds": -3}, "graceSeconds"),
                        ({"graceSeconds": "nan"}, "graceSeconds"), ({"graceSeconds": 1e300}, "graceSeconds")]:
        answer = client.post("/_emulator/preempt", json={"execution": execution, **body})
        assert answer.status_code == 400 and field in answer.json()["error"]["message"], (body, answer.json())
    assert client.get(f"/_emulator/logs/{P}/jobs/j/executions/e").status_code == 404
    assert client.get(f"/_emulator/attempts/{P}/jobs/j/executions/e").json()["error"]["status"] == "NOT_FOUND"
