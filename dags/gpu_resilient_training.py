"""Train a PyTorch classifier on a Cloud Run GPU job that survives maintenance preemptions.

create_bucket -> grant_bucket_access -> upload_dataset -> deploy_job -> execute_job -> report,
with cleanup as a teardown (it runs after failures too):

- ``create_bucket``: the checkpoint bucket, regional (in the job's region), standard class;
- ``grant_bucket_access``: ``roles/storage.objectAdmin`` for the job's service account, on
  that bucket only;
- ``upload_dataset``: scikit-learn's handwritten-digits set as ``data/digits.npz``;
- ``deploy_job``: the GPU job (L4, no zonal redundancy, task timeout, max retries 3, the bucket
  mounted at ``/checkpoints``); idempotent;
- ``execute_job``: runs it, deferrable; a preempted task resumes from its last committed
  checkpoint, through Cloud Run's retries and, when those run out, the operator's re-runs. Each
  DAG run has its own checkpoint namespace (``CHECKPOINT_RUN_ID``, from the run id): clearing a
  task resumes that run's checkpoints; a new run, with other params or not, trains afresh;
- ``report``: held-out accuracy, steps, attempts and lost work from each task's ``metrics.json``;
- ``cleanup``: deletes the job; deletes the bucket too when the ``delete_bucket`` param says so.

Everything a user changes is a DAG param or the ``google_cloud_platform`` connection named by
``gcp_conn_id``. With a connection whose extra holds ``api_endpoint`` (the local Cloud Run
emulator) and ``STORAGE_EMULATOR_HOST`` set (the local GCS emulator), the DAG runs on a laptop;
with a connection without ``api_endpoint`` the same file targets real Cloud Run.
"""

from __future__ import annotations

import pendulum
from airflow.providers.google.cloud.hooks.gcs import GCSHook
from airflow_gpu_resilience.compat import DAG, Param, task
from gpu_training_common import (
    common_params,
    create_bucket_operator,
    deploy_operator,
    execute_operator,
    grant_bucket_access,
    namespace_for,
    report,
    upload_dataset,
)

from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook


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
    params={
        **common_params("gpu-resilient-training"),
        "delete_bucket": Param(False, type="boolean", description="Delete the bucket in cleanup"),
    },
    user_defined_macros={"namespace_for": namespace_for},
    render_template_as_native_obj=True,
    tags=["gpu", "cloud-run", "example"],
) as dag:
    create_bucket = create_bucket_operator()
    deploy = deploy_operator()
    execute = execute_operator()
    done = cleanup()
    create_bucket >> grant_bucket_access() >> upload_dataset() >> deploy >> execute
    report(execute.output, namespace="{{ namespace_for(run_id) }}") >> done
    done.as_teardown(setups=create_bucket)
