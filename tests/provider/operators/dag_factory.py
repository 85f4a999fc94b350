"""DAGs for the operator tests, built the same way in the test and in the dags folder.

``dag.test()`` in Airflow 3 needs the DAG serialized from a DAG bundle, so each test writes a
two-line file into the dags folder that calls the same factory with the same arguments, and
runs the in-test copy (whose callbacks and tasks run in this process).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pendulum

from airflow.providers.common.compat.sdk import DAG, task

from airflow_gpu_resilience.sensors.cloud_run import CloudRunGpuExecutionSensor
from airflow_gpu_resilience.operators.cloud_run import (
    CloudRunGpuDeployJobOperator,
    CloudRunGpuExecuteJobOperator,
)

REGION = "us-central1"
START = pendulum.datetime(2026, 1, 1, tz="UTC")

#: What the in-process task runs captured: summaries passed downstream, exceptions of failures.
CAPTURED: dict[str, list] = {"summaries": [], "errors": []}


def capture_error(context) -> None:
    CAPTURED["errors"].append(context.get("exception"))


@task
def keep(summary):
    CAPTURED["summaries"].append(summary)


def execute_dag(dag_id: str, job_name: str, retries: int = 0, **op_kwargs: Any) -> DAG:
    """``execute`` (the execute operator) -> ``keep`` (stores its summary).

    ``execution_timeout_seconds`` becomes the operator's ``execution_timeout`` (JSON has no timedelta).
    """
    op_kwargs.setdefault("poll_interval", 0.2)
    if "execution_timeout_seconds" in op_kwargs:
        op_kwargs["execution_timeout"] = pendulum.duration(seconds=op_kwargs.pop("execution_timeout_seconds"))
    with DAG(dag_id=dag_id, schedule=None, start_date=START, catchup=False) as dag:
        op = CloudRunGpuExecuteJobOperator(
            task_id="execute", job_name=job_name, region=REGION, retries=retries,
            retry_delay=pendulum.duration(seconds=0), on_failure_callback=capture_error, **op_kwargs,
        )
        keep(op.output)
    return dag


def deploy_dag(dag_id: str, job_name: str, image: str, bucket: str) -> DAG:
    """Deploy (templated max_retries) -> keep -> deploy the same spec again -> keep."""
    with DAG(dag_id=dag_id, schedule=None, start_date=START, catchup=False,
             render_template_as_native_obj=True, params={"retries": 2}) as dag:
        common = {"job_name": job_name, "image": image, "args": ["ok"], "region": REGION,
                  "checkpoint_bucket": bucket, "task_timeout": 7200}
        first = CloudRunGpuDeployJobOperator(task_id="deploy", max_retries="{{ params.retries }}", **common)
        second = CloudRunGpuDeployJobOperator(task_id="deploy_again", max_retries=2, **common)
        keep.override(task_id="keep1")(first.output) >> second
        keep.override(task_id="keep2")(second.output)
    return dag


def sensor_dag(dag_id: str, job_name: str, execution: str, deferrable: bool, mode: str = "poke") -> DAG:
    """``wait`` (the execution sensor on a short execution id) -> ``keep``."""
    with DAG(dag_id=dag_id, schedule=None, start_date=START, catchup=False) as dag:
        sensor = CloudRunGpuExecutionSensor(
            task_id="wait", execution=execution, job_name=job_name, region=REGION, deferrable=deferrable,
            poke_interval=0.2, timeout=60, mode=mode, on_failure_callback=capture_error,
        )
        keep(sensor.output)
    return dag


def write_dag_file(dags_folder: Path, factory: str, kwargs: dict[str, Any]) -> Path:
    """Write the dags-folder twin of ``factory(**kwargs)``; return its path."""
    path = Path(dags_folder) / f"{kwargs['dag_id']}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "# airflow DAG (twin of a test DAG)\nimport json\n"
        f"from tests.provider.operators.dag_factory import {factory}\n"
        f"dag = {factory}(**json.loads({json.dumps(json.dumps(kwargs))}))\n"
    )
    return path
