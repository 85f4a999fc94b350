"""The training DAG for teams without a triggerer: start the execution, then sense it.

check_job_is_ours -> create_bucket -> grant_bucket_access -> upload_dataset -> deploy_job
-> start_execution -> wait_for_execution (reschedule mode) -> report

``check_job_is_ours`` and ``create_bucket`` fail, before anything is changed, on a job or
bucket of that name that is not ours (no ``managed-by=airflow-gpu-resilience`` label).

``start_execution`` runs the job and returns at once (``wait_for_completion=False``), pushing
the execution name to XCom. ``wait_for_execution`` is the execution sensor in ``reschedule``
mode: between pokes (every 30 s) it gives its worker slot back, so a multi-hour GPU job holds no Airflow slot
and needs no triggerer. Preemptions are absorbed by Cloud Run's own retries (``max_retries``);
the worker resumes each retry from its last committed checkpoint. An execution that still fails
fails the sensor. Unlike ``gpu_resilient_training``, nothing here starts a new execution after
the retries run out: use the execute operator when you want that.
"""

from __future__ import annotations

import pendulum
from airflow.providers.common.compat.sdk import DAG
from gpu_training_common import (
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

from airflow_gpu_resilience.sensors.cloud_run import CloudRunGpuExecutionSensor

with DAG(
    dag_id="gpu_training_sensor",
    description="Cloud Run GPU training watched by a reschedule-mode sensor (no triggerer needed)",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    params=common_params("gpu-training-sensor"),
    user_defined_macros={"namespace_for": namespace_for},
    render_template_as_native_obj=True,
    tags=["gpu", "cloud-run", "example", "sensor"],
) as dag:
    bucket = create_bucket()
    deploy = deploy_operator()
    # [START howto_sensor_execution]
    start = execute_operator("start_execution", wait_for_completion=False)
    wait = CloudRunGpuExecutionSensor(
        task_id="wait_for_execution",
        execution="{{ ti.xcom_pull(task_ids='start_execution', key='execution_name') }}",
        gcp_conn_id="{{ params.gcp_conn_id }}",
        mode="reschedule",
        poke_interval=30.0,
        timeout=7 * 24 * 3600,
    )
    # [END howto_sensor_execution]
    check_job_is_ours() >> bucket >> grant_bucket_access() >> upload_dataset() >> deploy >> start >> wait
    wait >> report({"task_count": 1}, namespace="{{ namespace_for(run_id) }}")
