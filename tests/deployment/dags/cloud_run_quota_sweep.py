"""A sweep: one mapped, deferrable execute task runs twenty Cloud Run jobs at once.

The DAG of the quota deployment test (``tests/deployment/test_quota_deployment.py``), in a DAG
bundle of its own (``deployment-tests``, see ``tests/deployment/conftest.py``). The jobs exist
before the run (deployed once by the test, as a team's infrastructure code would), so each DAG
run is twenty task instances of one operator, mapped over the job names, and nothing else:
every execution is watched by a trigger in the triggerer, all of one project and region.
"""

from __future__ import annotations

import pendulum

from airflow.providers.common.compat.sdk import DAG

from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuExecuteJobOperator

DAG_ID = "cloud_run_quota_sweep"
PROJECT = "local-project"
REGION = "us-central1"
#: The sweep's jobs, one execution each, mapped in this order (map index = list index).
JOBS = [f"quota-sweep-{index:02d}" for index in range(20)]
#: Seconds between the watcher's polls of the region: at most 20 listings a minute, a third of
#: the test's read quota, so that the watcher alone never exhausts it.
POLL_INTERVAL_SECONDS = 3.0

with DAG(
    dag_id=DAG_ID,
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_tasks=len(JOBS),
    tags=["cloud-run", "test"],
) as dag:
    CloudRunGpuExecuteJobOperator.partial(
        task_id="execute_job",
        project_id=PROJECT,
        region=REGION,
        poll_interval=POLL_INTERVAL_SECONDS,
        max_preemption_reruns=3,
        # explicit: the deployment's scheduler may run with [operators] default_deferrable = False
        deferrable=True,
    ).expand(job_name=JOBS)
