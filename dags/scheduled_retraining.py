"""Daily retraining on the day's data partition, on the same Cloud Run GPU job every day.

check_job_is_ours -> create_bucket -> grant_bucket_access -> land_partition -> deploy_job
-> execute_job -> report

- ``land_partition`` stands in for the upstream system that lands each day's data at
  ``data/{{ ds }}/digits.npz`` in the checkpoint bucket (replace it with your own sensor or
  export); it writes the partition only when it is missing.
- ``deploy_job`` reuses the deployed job: deploying an unchanged spec changes nothing.
- ``execute_job`` points the worker at the day's partition and gives the run its own checkpoint
  namespace (``CHECKPOINT_RUN_ID``, derived from the run id) through the execution's overrides,
  so a rerun resumes its own run's checkpoints and never another day's; a backfill of another
  day starts fresh.
- ``catchup`` is off and at most one run is active, so two days never share the GPU job's
  checkpoints or its quota.

Creating the bucket and granting access are idempotent too: the bucket from an earlier run
(labelled ``managed-by=airflow-gpu-resilience``, same project) and an existing binding are left
as they are; a bucket of that name that is not ours fails ``create_bucket`` before anything
touches it.
"""

from __future__ import annotations

import pendulum
from airflow.providers.common.compat.sdk import DAG
from gpu_training_common import (
    WORKER_ARGS,
    common_params,
    check_job_is_ours,
    create_bucket,
    deploy_operator,
    execute_operator,
    grant_bucket_access,
    namespace_for,
    report,
    upload_dataset,
)


PARTITION_OBJECT = "data/{{ ds }}/digits.npz"

with DAG(
    dag_id="scheduled_retraining",
    description="Daily preemption-resilient retraining on the day's data partition",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    params=common_params("digits-retraining"),
    user_defined_macros={"namespace_for": namespace_for},
    render_template_as_native_obj=True,
    tags=["gpu", "cloud-run", "example", "scheduled"],
) as dag:
    bucket = create_bucket()
    land = upload_dataset.override(task_id="land_partition")(object_name=PARTITION_OBJECT, partition="{{ ds }}")
    deploy = deploy_operator()
    # [START howto_operator_execute_job_overrides]
    execute = execute_operator(
        overrides={
            "container_overrides": [
                {
                    "args": [*WORKER_ARGS, "--data=" + PARTITION_OBJECT],
                    "env": [{"name": "CHECKPOINT_RUN_ID", "value": "{{ namespace_for(run_id) }}"}],
                }
            ]
        },
    )
    # [END howto_operator_execute_job_overrides]
    check_job_is_ours() >> bucket >> grant_bucket_access() >> land >> deploy >> execute
    report(execute.output, namespace="{{ namespace_for(run_id) }}")
