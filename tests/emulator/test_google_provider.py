"""The Airflow google provider's own Cloud Run operators against the emulator, via ``dag.test()``.

Only the hook's endpoint is changed (:class:`~.google_provider_dags.EmulatorCloudRunHook`,
patched in where the operators look the hook up); the client is the real ``run_v2`` REST client.
The execute operator runs non-deferrable: in deferrable mode its trigger uses
``JobsAsyncClient``, whose only transport is gRPC (``grpc_asyncio``), which the emulator does
not serve. (With ``transport="rest"`` the trigger runs the sync REST client in a thread instead;
that variant is tested too, with the trigger's hook patched the same way.)
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from airflow.providers.google.cloud.hooks import cloud_run as google_hooks
from airflow.providers.google.cloud.operators import cloud_run as google_operators
from airflow.utils.state import DagRunState, TaskInstanceState
from google.api_core import exceptions as gexc

from tests.provider.conftest import airflow_db  # noqa: F401  (the fixture: a migrated Airflow DB)

from . import google_provider_dags as dags

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
    assert states(dag_run) == {t: TaskInstanceState.SUCCESS for t in ("create", "execute", "delete")}
    assert dag_run.state == DagRunState.SUCCESS and dags.FAILURES == []
    with pytest.raises(gexc.NotFound):
        jobs.get_job(name=f"projects/{dags.PROJECT}/locations/{dags.REGION}/jobs/{job_id}")


def test_google_execute_operator_fails_when_a_task_exits_1(run_google_dag, emulator, job_id):
    dag_run = run_google_dag(job_name=job_id, exit_code=1)
    assert states(dag_run) == {"create": TaskInstanceState.SUCCESS, "execute": TaskInstanceState.FAILED,
                               "delete": TaskInstanceState.SUCCESS}
    assert dag_run.state == DagRunState.FAILED
    [error] = dags.FAILURES
    assert "task0 failed with message" in str(error)  # the RunJob operation's error, as Cloud Run sets it
    logs = list((emulator.data_dir / "logs").glob(f"{job_id}-*/task0-attempt*.log"))
    assert sorted(p.name for p in logs) == ["task0-attempt0.log", "task0-attempt1.log"]  # maxRetries 1
