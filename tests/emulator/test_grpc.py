"""Black-box tests: the real run_v2 clients on their default transport, gRPC, against the emulator.

The sync clients (``grpc_jobs``, ``grpc_executions``, ``grpc_tasks``) share an insecure channel
to the emulator's gRPC port; the async clients run on ``grpc.aio``. Both servers share one
backend: what one transport creates, the other sees, and the same bad request gets the same
status and message from both.
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import urllib.error
import urllib.request

import grpc
import pytest
from google.api_core import exceptions as gexc
from google.cloud import run_v2
from google.cloud.run_v2.services.executions.transports import ExecutionsGrpcAsyncIOTransport
from google.cloud.run_v2.services.jobs.transports import JobsGrpcAsyncIOTransport
from google.cloud.run_v2.services.tasks.transports import TasksGrpcAsyncIOTransport
from google.longrunning import operations_pb2

from cloud_run_emulator.models import PREEMPTION_MESSAGE
from cloud_run_emulator.process import post_json

from .conftest import PARENT, create, make_job, task_name, wait_running

State = run_v2.Condition.State


def test_create_run_list_get_and_delete_over_grpc(grpc_jobs, grpc_executions, grpc_tasks, jobs, job_id):
    job = create(grpc_jobs, job_id, make_job("local/exit:latest", task_count=2))
    assert job.name == f"{PARENT}/jobs/{job_id}" and jobs.get_job(name=job.name).uid == job.uid  # one backend
    op = grpc_jobs.run_job(name=job.name)
    assert op.metadata.name.startswith(f"{job.name}/executions/")  # RunJob's LRO carries the execution
    execution = op.result(timeout=30)  # polls google.longrunning.Operations/GetOperation
    assert execution.succeeded_count == 2 and execution.conditions[-1].state == State.CONDITION_SUCCEEDED
    assert [e.name for e in grpc_executions.list_executions(parent=job.name)] == [execution.name]
    assert grpc_executions.get_execution(name=execution.name).completion_time == execution.completion_time
    listed = list(grpc_tasks.list_tasks(parent=execution.name))
    assert [t.index for t in listed] == [0, 1] and all(t.last_attempt_result.exit_code == 0 for t in listed)
    assert grpc_tasks.get_task(name=task_name(execution.name, 1)).name == listed[1].name
    raw = grpc_jobs.wait_operation(request={"name": op.operation.name, "timeout": {"seconds": 5}})
    # google-cloud-run's gRPC WaitOperation stub has no response deserializer: it hands back bytes
    waited = raw if isinstance(raw, operations_pb2.Operation) else operations_pb2.Operation.FromString(raw)
    assert waited.done and waited.name == op.operation.name
    names = [o.name for o in grpc_jobs.list_operations(request={"name": PARENT}).operations]
    assert op.operation.name in names
    deleted = grpc_jobs.delete_job(name=job.name).result(timeout=10)
    assert deleted.name == job.name
    with pytest.raises(gexc.NotFound):
        grpc_jobs.get_job(name=job.name)
    with pytest.raises(gexc.NotFound):
        jobs.get_job(name=job.name)


def test_preempted_attempt_is_retried_into_success_over_grpc(grpc_jobs, grpc_tasks, emulator, job_id):
    job = create(grpc_jobs, job_id, make_job("local/sleep:1"))
    op = grpc_jobs.run_job(name=job.name)
    wait_running(grpc_tasks, task_name(op.metadata.name, 0))
    emulator.preempt(op.metadata.name, 0, grace_seconds=5)  # the admin endpoint, as on REST
    execution = op.result(timeout=30)
    assert execution.succeeded_count == 1 and execution.retried_count == 1
    task = grpc_tasks.get_task(name=task_name(execution.name, 0))
    assert task.retried == 1 and task.last_attempt_result.status.code == 0
    first, second = emulator.attempts(execution.name)
    assert (first["exitCode"], first["statusCode"], first["stopReason"]) == (143, 14, "preempted")
    assert first["message"] == PREEMPTION_MESSAGE and (second["attempt"], second["exitCode"]) == (1, 0)


def test_cancel_and_failed_execution_over_grpc(grpc_jobs, grpc_executions, grpc_tasks, job_id):
    job = create(grpc_jobs, job_id, make_job("local/sleep:1", task_count=2, parallelism=1))
    run_op = grpc_jobs.run_job(name=job.name)
    wait_running(grpc_tasks, task_name(run_op.metadata.name, 0))
    with pytest.raises(gexc.FailedPrecondition, match="has a running execution"):  # REST: BadRequest
        grpc_jobs.delete_job(name=job.name)
    cancelled = grpc_executions.cancel_execution(name=run_op.metadata.name).result(timeout=30)
    assert cancelled.cancelled_count == 2
    assert run_op.result(timeout=30).cancelled_count == 2  # a cancelled execution's LRO has no error
    failing = create(grpc_jobs, f"{job_id}-f", make_job("local/exit:latest", env={"CODE": "1"}, max_retries=1))
    op = grpc_jobs.run_job(name=failing.name)
    with pytest.raises(gexc.FailedPrecondition, match="task0 failed with message"):
        op.result(timeout=30)
    assert op.operation.error.code == 9 and grpc_tasks.get_task(name=task_name(op.metadata.name, 0)).retried == 1


def _bad_requests(job_id: str) -> list:
    """``(what, call(jobs, executions, tasks), status)``: requests both transports refuse."""
    job = f"{PARENT}/jobs/{job_id}"
    override = run_v2.RunJobRequest.Overrides

    def run(**overrides):
        return lambda j, e, t: j.run_job(request=run_v2.RunJobRequest(name=job, overrides=override(**overrides)))

    return [
        ("missing job", lambda j, e, t: j.get_job(name=f"{PARENT}/jobs/missing"), "NOT_FOUND"),
        ("existing job", lambda j, e, t: j.create_job(parent=PARENT, job=make_job("local/exit:latest"),
                                                      job_id=job_id), "ALREADY_EXISTS"),
        ("bad max_retries", lambda j, e, t: j.create_job(parent=PARENT, job=make_job("local/exit:latest",
                                                         max_retries=11), job_id=f"{job_id}-x"), "INVALID_ARGUMENT"),
        ("task_count override", run(task_count=10_001), "INVALID_ARGUMENT"),
        ("env override", run(container_overrides=[{"env": [{"name": "A=B", "value": "1"}]}]), "INVALID_ARGUMENT"),
        ("etag", lambda j, e, t: j.run_job(request=run_v2.RunJobRequest(name=job, etag='"nope"')),
         "FAILED_PRECONDITION"),
        ("missing execution", lambda j, e, t: list(t.list_tasks(parent=f"{job}/executions/{job_id}-zzzzz")),
         "NOT_FOUND"),
        ("missing operation", lambda j, e, t: j.get_operation(request={"name": f"{PARENT}/operations/nope"}),
         "NOT_FOUND"),
        ("bad project", lambda j, e, t: j.get_job(name="projects/UPPER/locations/us-central1/jobs/x"),
         "INVALID_ARGUMENT"),
    ]


def test_errors_have_the_rest_sides_status_and_message(grpc_jobs, grpc_executions, grpc_tasks, jobs, executions,
                                                       tasks, job_id):
    create(jobs, job_id, make_job("local/exit:latest"))
    for what, call, status in _bad_requests(job_id):
        with pytest.raises(gexc.GoogleAPICallError) as over_rest:
            call(jobs, executions, tasks)
        with pytest.raises(gexc.GoogleAPICallError) as over_grpc:
            call(grpc_jobs, grpc_executions, grpc_tasks)
        rest_error = over_rest.value.response.json()["error"]
        assert rest_error["status"] == status, what
        assert over_grpc.value.grpc_status_code == getattr(grpc.StatusCode, status), what
        assert over_grpc.value.message == rest_error["message"], what
    assert not list(executions.list_executions(parent=f"{PARENT}/jobs/{job_id}"))  # no refused run started


def test_grpc_errors_arrive_as_their_own_exception_classes(grpc_jobs, job_id):
    """Over REST INVALID_ARGUMENT and FAILED_PRECONDITION are both BadRequest and ALREADY_EXISTS is
    Conflict (by HTTP code); over gRPC each code has its class."""
    job = create(grpc_jobs, job_id, make_job("local/exit:latest"))
    with pytest.raises(gexc.AlreadyExists, match="already exists"):
        create(grpc_jobs, job_id, make_job("local/exit:latest"))
    with pytest.raises(gexc.InvalidArgument, match="overrides.task_count"):
        grpc_jobs.run_job(request=run_v2.RunJobRequest(name=job.name, overrides={"task_count": 10_001}))
    with pytest.raises(gexc.InvalidArgument, match="name: 'nope' is not of the form"):
        grpc_jobs.get_job(name="nope")
    with pytest.raises(gexc.FailedPrecondition, match="etag"):
        grpc_jobs.run_job(request=run_v2.RunJobRequest(name=job.name, etag='"nope"'))
    with pytest.raises(gexc.MethodNotImplemented):  # IAM is not emulated
        grpc_jobs.get_iam_policy(request={"resource": job.name})


def test_injected_faults_apply_over_grpc(grpc_jobs, emulator, job_id):
    job = create(grpc_jobs, job_id, make_job("local/exit:latest"))
    post_json(emulator.endpoint + "/_emulator/faults", {"failNext": 1, "codes": [429]})
    try:
        with pytest.raises(gexc.ResourceExhausted, match="Injected fault"):
            grpc_jobs.get_job(name=job.name, retry=None)
        assert grpc_jobs.get_job(name=job.name).uid == job.uid
        post_json(emulator.endpoint + "/_emulator/faults", {"loseAnswerNext": 1, "loseAnswerCode": 504})
        with pytest.raises(gexc.DeadlineExceeded, match="applied but its answer was lost"):
            grpc_jobs.create_job(parent=PARENT, job=make_job("local/exit:latest"), job_id=f"{job_id}-b", retry=None)
        assert grpc_jobs.get_job(name=f"{PARENT}/jobs/{job_id}-b").name.endswith("-b")  # it was applied
    finally:
        post_json(emulator.endpoint + "/_emulator/faults", {})


def test_async_grpc_clients(emulator, jobs, job_id):
    async def scenario() -> tuple:
        async with grpc.aio.insecure_channel(emulator.grpc_endpoint) as channel:
            a_jobs = run_v2.JobsAsyncClient(transport=JobsGrpcAsyncIOTransport(channel=channel))
            a_executions = run_v2.ExecutionsAsyncClient(transport=ExecutionsGrpcAsyncIOTransport(channel=channel))
            a_tasks = run_v2.TasksAsyncClient(transport=TasksGrpcAsyncIOTransport(channel=channel))
            job = await (await a_jobs.create_job(parent=PARENT, job=make_job("local/exit:latest", task_count=2),
                                                 job_id=job_id)).result()
            execution = await (await a_jobs.run_job(name=job.name)).result(timeout=30)
            fetched = await a_executions.get_execution(name=execution.name)
            listed = [t async for t in await a_tasks.list_tasks(parent=execution.name)]
            with pytest.raises(gexc.NotFound):
                await a_jobs.get_job(name=f"{PARENT}/jobs/missing")
            with pytest.raises(gexc.InvalidArgument, match="overrides.task_count"):
                await a_jobs.run_job(request=run_v2.RunJobRequest(name=job.name, overrides={"task_count": 10_001}))
            await (await a_jobs.delete_job(name=job.name)).result()
            return execution, fetched, listed

    execution, fetched, listed = asyncio.run(scenario())
    assert execution.succeeded_count == 2 and fetched.name == execution.name
    assert [t.index for t in listed] == [0, 1]
    with pytest.raises(gexc.NotFound):
        jobs.get_job(name=f"{PARENT}/jobs/{job_id}")


def test_a_browsers_http1_request_cannot_reach_the_grpc_port(emulator, jobs, job_id):
    """What a web page can send (HTTP/1.1, whatever its method, path or body) runs no method:
    the server reads no HTTP/2 preface and drops the connection without an HTTP answer."""
    host, port = emulator.grpc_endpoint.rsplit(":", 1)
    body = run_v2.CreateJobRequest.serialize(run_v2.CreateJobRequest(
        parent=PARENT, job_id=job_id, job=make_job("local/exit:latest")))
    request = (f"POST /google.cloud.run.v2.Jobs/CreateJob HTTP/1.1\r\nHost: {emulator.grpc_endpoint}\r\n"
               f"Origin: http://evil.example\r\nContent-Type: application/grpc\r\nTE: trailers\r\n"
               f"Content-Length: {len(body) + 5}\r\n\r\n").encode() + b"\0" + len(body).to_bytes(4, "big") + body
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):  # the server closes the connection
            answer += chunk
    assert not answer.startswith(b"HTTP/")
    with pytest.raises((http.client.HTTPException, OSError)) as err:  # HTTP/2 frames, no status line
        urllib.request.urlopen(f"http://{emulator.grpc_endpoint}/", timeout=10)
    assert not isinstance(err.value, urllib.error.HTTPError)
    with pytest.raises(gexc.NotFound):
        jobs.get_job(name=f"{PARENT}/jobs/{job_id}")


def _proxy_answer(emulator, request: bytes) -> bytes:
    host, port = emulator.google_endpoint_env["grpc_proxy"].removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(request)
        return conn.recv(4096)


@pytest.mark.parametrize(("request_line", "status"), [
    ("GET / HTTP/1.1", b"405"),  # what a page can send
    ("POST /google.cloud.run.v2.Jobs/CreateJob HTTP/1.1", b"405"),
    ("CONNECT www.example.com:443 HTTP/1.1", b"403"),  # not an open proxy
    ("CONNECT oauth2.googleapis.com:443 HTTP/1.1", b"403"),  # other Google APIs fail at once
    ("CONNECT run.googleapis.com:80 HTTP/1.1", b"403"),
    ("CONNECT 127.0.0.1:22 HTTP/1.1", b"403"),
    ("CONNECT run.googleapis.com:443 HTTP/1.1", b"200"),
    ("CONNECT europe-west4-run.googleapis.com:443 HTTP/1.1", b"200"),
])
def test_the_google_endpoint_proxy_leads_only_cloud_run_hosts_to_the_emulator(emulator, request_line, status):
    answer = _proxy_answer(emulator, f"{request_line}\r\nHost: 127.0.0.1\r\n\r\n".encode())
    assert answer.split(b" ")[1] == status, answer

