"""An Airflow DAG of the google provider's own Cloud Run operators, for runs against the emulator.

``dag.test()`` in Airflow 3 takes the DAG from a DAG bundle, so a test writes a small twin file
into the dags folder (:func:`write_dag_file`) that calls :func:`google_cloud_run_dag` with the
same arguments, and runs its in-test copy (whose operators and callbacks run in the test's
process, where :class:`EmulatorCloudRunHook` has been patched in).
"""

from __future__ import annotations

import json
from pathlib import Path

import pendulum
from airflow.providers.google.cloud.hooks.cloud_run import CloudRunHook
from airflow.providers.google.cloud.operators.cloud_run import (
    CloudRunCreateJobOperator,
    CloudRunDeleteJobOperator,
    CloudRunExecuteJobOperator,
)
from airflow_gpu_resilience.compat import DAG
from google.cloud import run_v2

from .conftest import make_job

PROJECT, REGION = "test-project", "us-central1"

#: Exceptions of failed tasks of the in-test DAG copies (``on_failure_callback``).
FAILURES: list = []


class EmulatorCloudRunHook(CloudRunHook):
    """The google provider's ``CloudRunHook`` with only its endpoint pointed at the emulator.

    The emulator serves REST only, so the transport is ``rest`` whatever the operator asks
    (``CloudRunCreateJobOperator`` and ``CloudRunDeleteJobOperator`` pass none, which would
    pick gRPC). Everything else (credentials from the connection, requests, operations) is the
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


def gpu_job(exit_code: int) -> run_v2.Job:
    """An L4 GPU job whose one task exits ``exit_code`` (max retries 1, BETA for a 2 h timeout)."""
    return make_job("local/exit:latest", env={"CODE": str(exit_code)}, max_retries=1, gpu=True,
                    timeout_s=7200, launch_stage=3)


def google_cloud_run_dag(dag_id: str, job_name: str, exit_code: int = 0, deferrable: bool = False) -> DAG:
    """create -> execute -> delete, the delete a teardown of create: it runs even after a
    failure, and the DAG run's state is the execute task's."""
    common = {"project_id": PROJECT, "region": REGION, "job_name": job_name, "on_failure_callback": record_failure}
    with DAG(dag_id=dag_id, schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False) as dag:
        create = CloudRunCreateJobOperator(task_id="create", job=gpu_job(exit_code), **common)
        execute = CloudRunExecuteJobOperator(
            task_id="execute", deferrable=deferrable, transport="rest", polling_period_seconds=0.2, **common)
        delete = CloudRunDeleteJobOperator(task_id="delete", **common)
        create >> execute >> delete.as_teardown(setups=create)
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
