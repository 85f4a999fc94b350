"""How CloudRunGpuHook builds its clients: ``CLOUD_RUN_EMULATOR_HOST`` (gRPC to the emulator,
anonymous, no connection extra needed) before the connection's ``api_endpoint`` (REST)."""

from __future__ import annotations

import json

import pytest
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud.run_v2.services.jobs.transports import JobsGrpcTransport, JobsRestTransport

from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.hooks.cloud_run_retry import error_status
from airflow_gpu_resilience.hooks.cloud_run_clients import EMULATOR_HOST_ENV, emulator_host
from airflow_gpu_resilience.job_spec import GpuJobSpec
from tests.provider.conftest import BUCKET, PROJECT, REGION, STUB_IMAGE


def _connection(monkeypatch, conn_id: str, extra: dict) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}",
                       json.dumps({"conn_type": "google_cloud_platform", "extra": extra}))


@pytest.mark.parametrize(("value", "expected"), [
    (None, None),
    ("", None),
    ("  ", None),
    ("127.0.0.1:8124", "127.0.0.1:8124"),
    (" localhost:1 ", "localhost:1"),
    ("[::1]:65535", "[::1]:65535"),
])
def test_emulator_host_values(value, expected):
    assert emulator_host({} if value is None else {EMULATOR_HOST_ENV: value}) == expected


@pytest.mark.parametrize("value", ["http://127.0.0.1:8124", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000",
                                   "127.0.0.1:port", "host:80/path"])
def test_a_bad_emulator_host_is_one_error_naming_the_variable(value):
    with pytest.raises(ValueError, match=rf"^CLOUD_RUN_EMULATOR_HOST={value!r}: give host:port .* e\.g\. 127\.0\.0\.1"):
        emulator_host({EMULATOR_HOST_ENV: value})


def test_the_emulator_host_wins_over_the_connection(emulator, monkeypatch, capsys, job_name):
    """A connection with only a project, which would need ADC (none here), and an endpoint that
    answers nothing: under CLOUD_RUN_EMULATOR_HOST neither is used."""
    _connection(monkeypatch, "plain_gcp", {"project": PROJECT, "api_endpoint": "http://127.0.0.1:9"})
    monkeypatch.setenv(EMULATOR_HOST_ENV, emulator.grpc_endpoint)
    hook = CloudRunGpuHook(gcp_conn_id="plain_gcp")
    assert hook.transport == "grpc" and hook.project_id == PROJECT
    capsys.readouterr()
    jobs = hook.jobs_client(REGION)
    hook.tasks_client(REGION), hook.executions_client("europe-west4")
    assert isinstance(jobs._transport, JobsGrpcTransport)
    assert capsys.readouterr().out.count(  # Airflow's task logger writes to stdout here
        f"Cloud Run API: the emulator at {emulator.grpc_endpoint} (CLOUD_RUN_EMULATOR_HOST), over gRPC on an insecure "
        "channel with anonymous credentials; the connection's endpoint and credentials are not used") == 1
    created = hook.create_job(job_name=job_name, job=GpuJobSpec(name=job_name, image=STUB_IMAGE,
                                                                checkpoint_bucket=BUCKET), region=REGION)
    _, execution = hook.run_job(job_name=job_name, region=REGION)
    assert hook.wait_for_execution(execution, poll_interval=0.1, timeout=60).succeeded_count == 1
    assert created.name == f"projects/{PROJECT}/locations/{REGION}/jobs/{job_name}"


def test_the_emulator_host_needs_no_connection_extra(emulator, monkeypatch):
    _connection(monkeypatch, "bare_gcp", {})
    monkeypatch.setenv(EMULATOR_HOST_ENV, emulator.grpc_endpoint)
    hook = CloudRunGpuHook(gcp_conn_id="bare_gcp")
    credentials, project = hook.get_credentials_and_project_id()
    assert isinstance(credentials, AnonymousCredentials) and project is None
    with pytest.raises(gexc.NotFound, match="missing-job"):  # the call reached the emulator
        hook.get_job(job_name="missing-job", region=REGION, project_id=PROJECT)


def test_a_bad_emulator_host_fails_before_any_call(monkeypatch, gcp_conn):
    monkeypatch.setenv(EMULATOR_HOST_ENV, "http://127.0.0.1:8124")
    hook = CloudRunGpuHook(gcp_conn_id=gcp_conn)
    with pytest.raises(ValueError, match="CLOUD_RUN_EMULATOR_HOST='http://127.0.0.1:8124'"):
        hook.jobs_client(REGION)


@pytest.mark.parametrize("transport", ["rest"], indirect=True)
def test_without_the_variable_the_connections_endpoint_is_used_over_rest(gcp_conn, emulator, monkeypatch):
    monkeypatch.setenv(EMULATOR_HOST_ENV, "")  # set but empty: unset
    hook = CloudRunGpuHook(gcp_conn_id=gcp_conn)
    assert hook.transport == "rest" and isinstance(hook.jobs_client(REGION)._transport, JobsRestTransport)
    assert hook.jobs_client(REGION).api_endpoint == emulator.endpoint


@pytest.mark.parametrize("transport", ["grpc"], indirect=True)
def test_grpc_errors_keep_their_own_status(gcp_conn, job_name):
    """Over gRPC FAILED_PRECONDITION is its own class (over REST it is BadRequest; see
    test_rest_error_status_comes_from_the_body_not_the_http_code)."""
    hook = CloudRunGpuHook(gcp_conn_id=gcp_conn)
    hook.create_job(job_name=job_name, job=GpuJobSpec(name=job_name, image=STUB_IMAGE, checkpoint_bucket=BUCKET,
                                                      args=["sleep", "60"]), region=REGION)
    _, execution = hook.run_job(job_name=job_name, region=REGION)
    try:
        with pytest.raises(gexc.FailedPrecondition, match="still running") as info:
            hook.delete_execution(execution=execution)
        assert error_status(info.value) == "FAILED_PRECONDITION"
    finally:
        hook.cancel_execution(execution=execution, wait=True)
    hook.delete_execution(execution=execution)
    with pytest.raises(gexc.NotFound) as missing:
        hook.get_execution(execution=execution)
    assert error_status(missing.value) == "NOT_FOUND"
