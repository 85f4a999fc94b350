"""Train a PyTorch classifier on a Cloud Run GPU job that survives maintenance preemptions.

The DAG: create the checkpoint bucket -> upload the dataset -> deploy the GPU job -> execute it
(preemption-aware; a preempted task resumes from its last committed checkpoint) -> report the
held-out accuracy from ``metrics.json`` -> clean up (a teardown: it runs after failures too).

Everything a user changes is a DAG param or the ``google_cloud_platform`` connection named by
``gcp_conn_id``. With the defaults and a connection whose extra holds ``api_endpoint`` (the local
Cloud Run emulator) plus ``STORAGE_EMULATOR_HOST`` (the local GCS emulator), the DAG runs on a
laptop; with a connection without ``api_endpoint`` the same file targets real Cloud Run.
"""

from __future__ import annotations

import io
import json

import pendulum
from airflow.providers.google.cloud.hooks.gcs import GCSHook
from airflow.providers.google.cloud.operators.gcs import GCSCreateBucketOperator
from airflow.sdk import DAG, Param, task

from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.operators.cloud_run import (
    CloudRunGpuDeployJobOperator,
    CloudRunGpuExecuteJobOperator,
)

#: Object name of the dataset inside the checkpoint bucket: the worker's default ``--data``,
#: resolved against the mounted bucket.
DATASET_OBJECT = "data/digits.npz"

PARAMS = {
    "gcp_conn_id": Param("google_cloud_default", type="string", description="Airflow connection"),
    "project_id": Param("local-project", type="string"),
    "region": Param("us-central1", type="string", description="Cloud Run region with L4 GPUs"),
    "job_name": Param("gpu-resilient-training", type="string", pattern=r"^[a-z]([-a-z0-9]{0,47}[a-z0-9])?$"),
    "image": Param(
        "us-central1-docker.pkg.dev/local-project/ml/airflow-gpu-resilience-worker:latest",
        type="string",
        description="Worker image built from worker/ (the emulator maps it to `python -m worker`)",
    ),
    "bucket": Param("gpu-resilient-checkpoints", type="string", description="Checkpoint bucket"),
    "service_account": Param("gpu-trainer@local-project.iam.gserviceaccount.com", type="string"),
    "gpu_type": Param("nvidia-l4", enum=["nvidia-l4", "nvidia-rtx-pro-6000"]),
    "max_retries": Param(3, type="integer", minimum=0, maximum=10, description="Cloud Run retries per task"),
    "max_preemption_reruns": Param(3, type="integer", minimum=0, description="Re-runs after preemptions"),
    "task_timeout_seconds": Param(4 * 3600, type="integer", minimum=1, maximum=168 * 3600),
    "steps": Param(600, type="integer", minimum=1, description="Optimizer steps to train"),
    "checkpoint_every": Param(50, type="integer", minimum=1, description="Steps between checkpoints"),
    "hidden_units": Param(128, type="integer", minimum=1, description="Hidden units per MLP layer"),
    "seed": Param(0, type="integer", minimum=0, description="Training seed (same seed, same model)"),
    "step_delay_seconds": Param(0.0, type="number", minimum=0, description="Artificial delay per step"),
    "delete_bucket": Param(False, type="boolean", description="Delete the bucket in cleanup"),
}


@task
def upload_dataset(params: dict | None = None) -> str:
    """Export scikit-learn's handwritten-digits set (a fixed, stratified split) to the bucket.

    :return: the ``gs://`` URI of the uploaded ``.npz``.
    """
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    buffer = io.BytesIO()
    np.savez(buffer, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    GCSHook(gcp_conn_id=params["gcp_conn_id"]).upload(
        bucket_name=params["bucket"], object_name=DATASET_OBJECT, data=buffer.getvalue()
    )
    return f"gs://{params['bucket']}/{DATASET_OBJECT}"


@task
def grant_bucket_access(params: dict | None = None) -> None:
    """Grant the job's service account ``roles/storage.objectAdmin`` on the checkpoint bucket only.

    The binding is added to the bucket's IAM policy (not the project's), so the job can read and
    write its checkpoints and nothing else. Adding an existing binding changes nothing.
    """
    bucket = GCSHook(gcp_conn_id=params["gcp_conn_id"]).get_conn().bucket(params["bucket"])
    policy = bucket.get_iam_policy(requested_policy_version=3)
    member = f"serviceAccount:{params['service_account']}"
    for binding in policy.bindings:
        if binding["role"] == "roles/storage.objectAdmin" and member in binding["members"]:
            return
    policy.bindings.append({"role": "roles/storage.objectAdmin", "members": {member}})
    bucket.set_iam_policy(policy)


@task
def report(summary: dict, params: dict | None = None) -> dict:
    """Read each task's ``metrics.json`` from the bucket and log the held-out accuracy.

    :param summary: the execute operator's XCom summary.
    :return: ``{"tasks": [metrics per task index], "executions": [...], "preemptions": [...]}``.
    """
    gcs = GCSHook(gcp_conn_id=params["gcp_conn_id"])
    tasks = []
    for index in range(int(summary.get("task_count", 1))):
        blob = gcs.download(bucket_name=params["bucket"], object_name=f"{params['job_name']}/task-{index}/metrics.json")
        metrics = json.loads(blob)
        print(f"task {index}: held-out accuracy {metrics['accuracy']:.4f} after {metrics['steps']} steps")
        tasks.append(metrics)
    return {"tasks": tasks, "executions": summary.get("executions", []), "preemptions": summary.get("preemptions", [])}


@task
def cleanup(params: dict | None = None) -> None:
    """Delete the Cloud Run job; delete the bucket too when the ``delete_bucket`` param says so."""
    CloudRunGpuHook(gcp_conn_id=params["gcp_conn_id"]).delete_job(
        job_name=params["job_name"], project_id=params["project_id"], region=params["region"]
    )
    if params["delete_bucket"]:
        GCSHook(gcp_conn_id=params["gcp_conn_id"]).delete_bucket(bucket_name=params["bucket"], force=True)


with DAG(
    dag_id="gpu_resilient_training",
    description="Preemption-resilient PyTorch training on a Cloud Run GPU job",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    params=PARAMS,
    render_template_as_native_obj=True,
    tags=["gpu", "cloud-run", "example"],
) as dag:
    create_bucket = GCSCreateBucketOperator(
        task_id="create_bucket",
        bucket_name="{{ params.bucket }}",
        location="{{ params.region }}",
        storage_class="STANDARD",
        project_id="{{ params.project_id }}",
        gcp_conn_id="{{ params.gcp_conn_id }}",
    )
    deploy = CloudRunGpuDeployJobOperator(
        task_id="deploy_job",
        gcp_conn_id="{{ params.gcp_conn_id }}",
        project_id="{{ params.project_id }}",
        region="{{ params.region }}",
        job_name="{{ params.job_name }}",
        image="{{ params.image }}",
        args=[
            "train",
            "--steps={{ params.steps }}",
            "--checkpoint-every={{ params.checkpoint_every }}",
            "--step-delay={{ params.step_delay_seconds }}",
            "--hidden={{ params.hidden_units }}",
            "--seed={{ params.seed }}",
        ],
        gpu_type="{{ params.gpu_type }}",
        task_timeout="{{ params.task_timeout_seconds }}",
        max_retries="{{ params.max_retries }}",
        service_account="{{ params.service_account }}",
        checkpoint_bucket="{{ params.bucket }}",
    )
    execute = CloudRunGpuExecuteJobOperator(
        task_id="execute_job",
        gcp_conn_id="{{ params.gcp_conn_id }}",
        project_id="{{ params.project_id }}",
        region="{{ params.region }}",
        job_name="{{ params.job_name }}",
        max_preemption_reruns="{{ params.max_preemption_reruns }}",
    )
    done = cleanup()
    create_bucket >> grant_bucket_access() >> upload_dataset() >> deploy >> execute
    report(execute.output) >> done
    done.as_teardown(setups=create_bucket)
