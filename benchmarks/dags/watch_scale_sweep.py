"""One DAG per N for the watch-scale benchmark's deployment mode (``benchmarks/watch_scale_deployment.py``).

``watch_scale_n<N>`` maps the deferrable execute operator over N jobs that exist before the run
(:func:`job_names`, all of one project and region), so one DAG run is N deferred task instances
whose executions the triggerer watches. The benchmark sets, in every Airflow process's
environment, ``WATCH_SCALE_SIZES`` (the N values, comma-separated; default ``1,10,100``) and
``WATCH_SCALE_POLL`` (the operator's ``poll_interval`` in seconds; default 10).
"""

from __future__ import annotations

import os

import pendulum

from airflow.providers.common.compat.sdk import DAG

from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuExecuteJobOperator

PROJECT = "local-project"
REGION = "us-central1"
TASK_ID = "execute_job"


def dag_id(n: int) -> str:
    """:return: the id of the DAG that watches ``n`` executions."""
    return f"watch_scale_n{n}"


def job_names(n: int) -> list[str]:
    """:return: the ``n`` job ids that DAG :func:`dag_id` (``n``) maps over, map index = list index."""
    return [f"ws-n{n}-{index:04d}" for index in range(n)]


def _sizes() -> list[int]:
    return [int(size) for size in os.environ.get("WATCH_SCALE_SIZES", "1,10,100").split(",") if size.strip()]


for _n in _sizes():
    with DAG(
        dag_id=dag_id(_n),
        schedule=None,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        max_active_tasks=_n,
        tags=["cloud-run", "benchmark"],
    ) as _dag:
        CloudRunGpuExecuteJobOperator.partial(
            task_id=TASK_ID,
            project_id=PROJECT,
            region=REGION,
            poll_interval=float(os.environ.get("WATCH_SCALE_POLL", "10")),
            max_preemption_reruns=3,
            # explicit: the deployment may run with [operators] default_deferrable = False
            deferrable=True,
        ).expand(job_name=job_names(_n))
    globals()[_dag.dag_id] = _dag
