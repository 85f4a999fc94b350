"""An Airflow DAG of the google provider's own Cloud Run operators, for runs against the emulator.

``dag.test()`` in Airflow 3 takes the DAG from a DAG bundle, so a test writes a small twin file
into the dags folder (:func:`write_dag_file`) that calls :func:`google_cloud_run_dag` with the
same arguments, and runs a copy of the DAG, either in its own process (REST: where
:class:`EmulatorCloudRunHook` has been patched in) or in a new one (gRPC, the operators' default
transport, unmodified: :func:`main`, run by :func:`run_in_new_process` with the emulator's
``google_endpoint_env``, which gRPC reads only when it is first imported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pendulum
from airflow.providers.common.compat.sdk import DAG
from airflow.providers.google.cloud.hooks.cloud_run import CloudRunHook
from airflow.providers.google.cloud.operators.cloud_run import (
    CloudRunCreateJobOperator,
    CloudRunDeleteJobOperator,
    CloudRunExecuteJobOperator,
    CloudRunListJobsOperator,
)
from google.cloud import run_v2

from .conftest import make_job

PROJECT, REGION = "test-project", "us-central1"
#: The line of :func:`main`'s output that carries its result (JSON after it).
RESULT_MARK = "GOOGLE-DAG-RESULT "
_REPO = Path(__file__).resolve().parents[2]

#: Exceptions of failed tasks of the in-test DAG copies (``on_failure_callback``).
FAILURES: list = []


class EmulatorCloudRunHook(CloudRunHook):
    """The google provider's ``CloudRunHook`` with only its endpoint pointed at the emulator's
    REST server, for the REST runs.

    The endpoint is a plain ``http://`` one, so the transport is ``rest`` whatever the operator
    asks (``CloudRunCreateJobOperator`` and ``CloudRunDeleteJobOperator`` pass none, which would
    pick gRPC, and gRPC through this hook would open TLS). Everything else (credentials from the connection, requests, operations) is the
    provider's own code. :attr:`endpoint` is set by the test.
    """

    endpoint = ""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.transport = "rest"

    def _get_api_endpoint(self, location=None, use_regional_endpoint=False) -> str:
        return self.endpoint


def record_failure(context) -> None:
    FAILURES.append(context.get("exception"))


def gpu_job(exit_code: int, preemptible: bool = False) -> run_v2.Job:
    """An L4 GPU job whose one task exits ``exit_code`` (max retries 1, BETA for a 2 h timeout);
    ``preemptible``: its first attempt sleeps until preempted (then exits 143), the next exits 0."""
    image = "local/sleep:1" if preemptible else "local/exit:latest"
    return make_job(image, env={"CODE": str(exit_code)}, max_retries=1, gpu=True, timeout_s=7200, launch_stage=3)


def google_cloud_run_dag(dag_id: str, job_name: str, exit_code: int = 0, deferrable: bool = False,
                         transport: str | None = "rest", preemptible: bool = False) -> DAG:
    """create -> list -> execute -> delete, the delete a teardown of create: it runs even after a
    failure, and the DAG run's state is the execute task's. ``transport=None`` leaves every
    operator on its default (gRPC)."""
    common = {"project_id": PROJECT, "region": REGION, "on_failure_callback": record_failure}
    with DAG(dag_id=dag_id, schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False) as dag:
        create = CloudRunCreateJobOperator(task_id="create", job=gpu_job(exit_code, preemptible), job_name=job_name,
                                           **common)
        listed = CloudRunListJobsOperator(task_id="list", **common)
        execute = CloudRunExecuteJobOperator(
            task_id="execute", deferrable=deferrable, transport=transport, polling_period_seconds=0.2,
            job_name=job_name, **common)
        delete = CloudRunDeleteJobOperator(task_id="delete", job_name=job_name, **common)
        create >> listed >> execute >> delete.as_teardown(setups=create)
    return dag


def write_dag_file(dags_folder: Path, **kwargs) -> Path:
    """Write the dags-folder twin of ``google_cloud_run_dag(**kwargs)``; return its path."""
    path = Path(dags_folder) / f"{kwargs['dag_id']}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "# airflow DAG: twin of a test DAG (google provider Cloud Run operators)\nimport json\n"
        "from tests.emulator.google_provider_dags import google_cloud_run_dag\n"
        f"dag = google_cloud_run_dag(**json.loads({json.dumps(json.dumps(kwargs))}))\n"
    )
    return path


def run_in_new_process(env: dict, **kwargs) -> subprocess.Popen:
    """Start :func:`main` for ``google_cloud_run_dag(**kwargs)`` in a new Python process with
    ``env`` added to this one's environment; read its result with :func:`result_of`."""
    return subprocess.Popen([sys.executable, "-m", "tests.emulator.google_provider_dags", json.dumps(kwargs)],
                            cwd=_REPO, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def result_of(process: subprocess.Popen, timeout: float = 300.0) -> dict:
    """Wait for a :func:`run_in_new_process` process; its result, ``{"states", "state",
    "failures", "listed"}`` (see :func:`main`).

    :raises AssertionError: with the process's output when it printed no result.
    """
    output, _ = process.communicate(timeout=timeout)
    lines = [line for line in output.splitlines() if line.startswith(RESULT_MARK)]
    assert lines, f"the DAG process (exit {process.returncode}) printed no result:\n{output[-6000:]}"
    return json.loads(lines[-1][len(RESULT_MARK):])


def main(argv: list) -> None:
    """Run ``google_cloud_run_dag(**json.loads(argv[0]))`` with ``dag.test()`` (its twin file
    written to the dags folder) and print one line: :data:`RESULT_MARK` and a JSON object of the
    task states, the DAG run's state, the failed tasks' exceptions and the names of the jobs the
    ``list`` task returned."""
    from airflow.configuration import conf

    kwargs = json.loads(argv[0])
    path = write_dag_file(Path(conf.get("core", "dags_folder")), **kwargs)
    try:
        dag_run = google_cloud_run_dag(**kwargs).test()
    finally:
        path.unlink(missing_ok=True)
    instances = {ti.task_id: ti for ti in dag_run.get_task_instances()}
    listed = instances["list"].xcom_pull(task_ids="list") or []
    print(RESULT_MARK + json.dumps({
        "states": {task: str(ti.state) for task, ti in instances.items()}, "state": str(dag_run.state),
        "failures": [f"{type(e).__name__}: {e}" for e in FAILURES], "listed": [job["name"] for job in listed],
    }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
