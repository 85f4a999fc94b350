"""The Airflow google provider's own Cloud Run operators against the emulator, via ``dag.test()``.

On gRPC, their default transport (the second half): nothing of the provider is replaced. Its
``CloudRunHook`` honours no ``*_EMULATOR_HOST`` variable and always opens a TLS channel to
``run.googleapis.com:443``, so the DAG runs in a new process whose environment leads gRPC there
(``grpc_proxy`` and ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``: the emulator's ``--google-endpoint``),
with an anonymous connection; sync and deferrable (the trigger's ``JobsAsyncClient`` on
``grpc_asyncio``).

On REST (the first half): only the hook's endpoint is changed
(:class:`~.google_provider_dags.EmulatorCloudRunHook`, patched in where the operators look the
hook up) and ``transport="rest"`` is forced; the client is the real ``run_v2`` REST client. With
``transport="rest"`` the deferrable trigger runs the sync REST client in a thread.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
from airflow.providers.google.cloud.hooks import cloud_run as google_hooks
from airflow.providers.google.cloud.operators import cloud_run as google_operators
from airflow.utils.state import DagRunState, TaskInstanceState
from google.api_core import exceptions as gexc

from tests.provider.conftest import airflow_db  # noqa: F401  (the fixture: a migrated Airflow DB)

from . import google_provider_dags as dags
from .conftest import task_name, wait_running

pytestmark = pytest.mark.usefixtures("airflow_db")


@pytest.fixture
def google_hook_on_emulator(emulator, monkeypatch):
    """Route the google provider's Cloud Run operators (and trigger) to the emulator."""
    monkeypatch.setattr(dags.EmulatorCloudRunHook, "endpoint", emulator.endpoint)
    monkeypatch.setattr(google_operators, "CloudRunHook", dags.EmulatorCloudRunHook)
    monkeypatch.setattr(google_hooks.CloudRunAsyncHook, "sync_hook_class", dags.EmulatorCloudRunHook)
    extra = {"is_anonymous": True, "project": dags.PROJECT}
    monkeypatch.setenv("AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT",
                       json.dumps({"conn_type": "google_cloud_platform", "extra": extra}))
    dags.FAILURES.clear()


@pytest.fixture
def run_google_dag(google_hook_on_emulator):
    """Run ``google_cloud_run_dag(**kwargs)`` with ``dag.test()``; return its DAG run."""
    from airflow.configuration import conf

    written = []

    def run(**kwargs):
        kwargs.setdefault("dag_id", f"google_{uuid.uuid4().hex[:10]}")
        written.append(dags.write_dag_file(Path(conf.get("core", "dags_folder")), **kwargs))
        return dags.google_cloud_run_dag(**kwargs).test()

    yield run
    for path in written:
        path.unlink(missing_ok=True)


def states(dag_run) -> dict:
    return {ti.task_id: ti.state for ti in dag_run.get_task_instances()}


@pytest.mark.parametrize("deferrable", [False, True])
def test_google_operators_create_execute_delete_succeed(run_google_dag, jobs, executions, job_id, deferrable):
    dag_run = run_google_dag(job_name=job_id, deferrable=deferrable)
    assert states(dag_run) == {t: TaskInstanceState.SUCCESS for t in ("create", "list", "execute", "delete")}
    assert dag_run.state == DagRunState.SUCCESS and dags.FAILURES == []
    with pytest.raises(gexc.NotFound):
        jobs.get_job(name=f"projects/{dags.PROJECT}/locations/{dags.REGION}/jobs/{job_id}")


def test_google_execute_operator_fails_when_a_task_exits_1(run_google_dag, emulator, job_id):
    dag_run = run_google_dag(job_name=job_id, exit_code=1)
    assert states(dag_run) == {"create": TaskInstanceState.SUCCESS, "list": TaskInstanceState.SUCCESS,
                               "execute": TaskInstanceState.FAILED, "delete": TaskInstanceState.SUCCESS}
    assert dag_run.state == DagRunState.FAILED
    [error] = dags.FAILURES
    assert "task0 failed with message" in str(error)  # the RunJob operation's error, as Cloud Run sets it
    logs = list((emulator.data_dir / "logs").glob(f"{job_id}-*/task0-attempt*.log"))
    assert sorted(p.name for p in logs) == ["task0-attempt0.log", "task0-attempt1.log"]  # maxRetries 1


# --- the operators on their default transport, gRPC, unmodified ------------------------------------------------

@pytest.fixture
def run_on_grpc(emulator, monkeypatch):
    """Start ``google_cloud_run_dag(transport=None, **kwargs)`` in a new process whose environment
    leads gRPC's channels for ``run.googleapis.com:443`` to the emulator (``google_endpoint_env``)
    and whose connection is only anonymous: no code of the google provider is replaced."""
    extra = {"is_anonymous": True, "project": dags.PROJECT}
    env = {**emulator.google_endpoint_env,
           "AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT": json.dumps({"conn_type": "google_cloud_platform", "extra": extra})}
    assert set(env) >= {"grpc_proxy", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"}
    started = []

    def start(**kwargs):
        kwargs.setdefault("dag_id", f"google_grpc_{uuid.uuid4().hex[:10]}")
        started.append(dags.run_in_new_process(env, transport=None, **kwargs))
        return started[-1]

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.communicate()


SUCCESS = "success"


@pytest.mark.parametrize("deferrable", [False, True])
def test_google_operators_on_grpc_create_list_execute_delete(run_on_grpc, jobs, job_id, deferrable):
    result = dags.result_of(run_on_grpc(job_name=job_id, deferrable=deferrable))
    assert result["states"] == dict.fromkeys(("create", "list", "execute", "delete"), SUCCESS), result
    assert result["state"] == SUCCESS and result["failures"] == []
    assert f"projects/{dags.PROJECT}/locations/{dags.REGION}/jobs/{job_id}" in result["listed"]
    with pytest.raises(gexc.NotFound):
        jobs.get_job(name=f"projects/{dags.PROJECT}/locations/{dags.REGION}/jobs/{job_id}")


@pytest.mark.parametrize("deferrable", [False, True])
def test_google_execute_operator_on_grpc_fails_when_a_task_exits_1(run_on_grpc, emulator, job_id, deferrable):
    result = dags.result_of(run_on_grpc(job_name=job_id, exit_code=1, deferrable=deferrable))
    assert result["states"] == {"create": SUCCESS, "list": SUCCESS, "execute": "failed", "delete": SUCCESS}, result
    assert result["state"] == "failed"
    [error] = result["failures"]
    assert "task0 failed with message" in error  # the RunJob operation's error, as Cloud Run sets it
    logs = list((emulator.data_dir / "logs").glob(f"{job_id}-*/task0-attempt*.log"))
    assert sorted(p.name for p in logs) == ["task0-attempt0.log", "task0-attempt1.log"]  # maxRetries 1


@pytest.mark.parametrize("deferrable", [False, True])
def test_google_execute_operator_on_grpc_succeeds_after_a_preempted_attempt(run_on_grpc, emulator, executions,
                                                                            tasks, job_id, deferrable):
    process = run_on_grpc(job_name=job_id, preemptible=True, deferrable=deferrable)
    job = f"projects/{dags.PROJECT}/locations/{dags.REGION}/jobs/{job_id}"
    execution = _first_execution(executions, job, process)
    wait_running(tasks, task_name(execution, 0), timeout=60)
    emulator.preempt(execution, 0, grace_seconds=5)
    result = dags.result_of(process)
    assert result["states"] == dict.fromkeys(("create", "list", "execute", "delete"), SUCCESS), result
    logs = emulator.data_dir / "logs" / execution.rsplit("/", 1)[-1]  # the job is deleted: its logs stay
    assert sorted(p.name for p in logs.glob("task0-attempt*.log")) == ["task0-attempt0.log", "task0-attempt1.log"]
    assert "SIGTERM received, exiting 143" in (logs / "task0-attempt0.log").read_text()
    assert "done" in (logs / "task0-attempt1.log").read_text()


def _first_execution(executions, job: str, process, timeout: float = 120.0) -> str:
    """The name of the job's first execution, once the DAG process has started it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, dags.result_of(process)
        try:
            found = list(executions.list_executions(parent=job))
        except gexc.NotFound:  # not created yet
            found = []
        if found:
            return found[0].name
        time.sleep(0.2)
    raise AssertionError(f"no execution of {job} within {timeout} s")

