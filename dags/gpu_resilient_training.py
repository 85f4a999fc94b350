"""Train a PyTorch classifier on a Cloud Run GPU job that survives maintenance preemptions.

check_job_is_ours -> create_bucket -> grant_bucket_access -> upload_dataset -> deploy_job
-> execute_job -> report, with cleanup as a teardown (it runs after failures too):

- ``check_job_is_ours``: a Cloud Run job of the ``job_name`` param that exists without the
  label ``managed-by=airflow-gpu-resilience`` is someone else's: fail before touching anything;
- ``create_bucket``: the checkpoint bucket, regional (in the job's region), standard class,
  labelled ``managed-by=airflow-gpu-resilience``; an existing bucket is used only if it is ours
  (that label, the same project), someone else's fails the task before anything touches it;
- ``grant_bucket_access``: ``roles/storage.objectAdmin`` for the job's service account, on
  that bucket only;
- ``upload_dataset``: scikit-learn's handwritten-digits set as ``data/digits.npz``;
- ``deploy_job``: the GPU job (L4, no zonal redundancy, task timeout, max retries 3, the bucket
  mounted at ``/checkpoints``, label ``managed-by=airflow-gpu-resilience``); idempotent;
- ``execute_job``: runs it, deferrable; a preempted task resumes from its last committed
  checkpoint, through Cloud Run's retries and, when those run out, the operator's re-runs. Each
  DAG run has its own checkpoint namespace (``CHECKPOINT_RUN_ID``, from the run id): clearing a
  task resumes that run's checkpoints; a new run, with other params or not, trains afresh;
- ``report``: held-out accuracy, steps, attempts and lost work from each task's ``metrics.json``;
- ``cleanup``: deletes the job if it is ours (its labels) and no execution of it runs (it waits
  ``cleanup_wait_seconds`` for one to end, then keeps the job; ``keep_job`` always keeps it);
  deletes the bucket too, if it is ours, when the ``delete_bucket`` param says so: its objects
  in batches, then the bucket, and reports the objects and bytes deleted.

Everything a user changes is a DAG param or the ``google_cloud_platform`` connection named by
``gcp_conn_id``. With a connection whose extra holds ``api_endpoint`` (the local Cloud Run
emulator) and ``STORAGE_EMULATOR_HOST`` set (the local GCS emulator), the DAG runs on a laptop;
with a connection without ``api_endpoint`` the same file targets real Cloud Run.
"""

from __future__ import annotations

import logging

import pendulum

from airflow.providers.common.compat.sdk import DAG, Param, task
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

from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.hooks.gcs import CheckpointBucketHook
from airflow_gpu_resilience.job_cleanup import JobCleanupAction

log = logging.getLogger(__name__)


@task
def cleanup(params: dict | None = None) -> dict:
    """Delete the Cloud Run job if it is ours and idle; delete the bucket too when ``delete_bucket`` says so.

    The job is deleted only when it carries ``JOB_LABELS`` (the deploy task sets them) and none of
    its executions is still running: a cancelled execution (the execute task marked failed) is
    waited for up to ``cleanup_wait_seconds``; one still running after that keeps the job, with a
    warning (deleting a job deletes its executions' records). ``keep_job`` keeps it in any case.
    A job of the same name that this DAG did not deploy is left as it is, with a warning. The
    bucket is deleted only when it is ours (see ``create_bucket``) and no execution of the job is
    still running (the job kept for one, or by ``keep_job``, may still write its checkpoints
    there); its objects go in batches first, so a bucket with thousands of checkpoints is deleted too.

    :return: ``{"job": "deleted" | "absent" | "not ours, kept" | "kept (keep_job)" | "kept: an
        execution is still running", "job_cleanup": {...}, "bucket": None or {"bucket", "deleted",
        "objects_deleted", "bytes_deleted"} (plus "reason" when it was kept for a running execution)}``.
    :raises CheckpointBucketNotOursError: ``delete_bucket`` is set and the bucket is not ours.
    """
    # [START howto_hook_delete_job_when_idle]
    run = CloudRunGpuHook(gcp_conn_id=params["gcp_conn_id"])
    result = run.delete_job_when_idle(
        job_name=params["job_name"], project_id=params["project_id"], region=params["region"],
        keep_job=params["keep_job"], wait_seconds=params["cleanup_wait_seconds"],
        poll_interval=min(5.0, params["poll_interval_seconds"]))
    log.info("Cleanup: job %s: %s", params["job_name"], result.action.value)
    # [END howto_hook_delete_job_when_idle]
    deleted = None
    running: list[str] = []
    if params["delete_bucket"] and result.action in (JobCleanupAction.KEEP_RUNNING, JobCleanupAction.KEEP_REQUESTED):
        running = list(result.unended_executions) or run.unended_executions(
            job_name=params["job_name"], project_id=params["project_id"], region=params["region"])
    if running:
        # the execution still writes its checkpoints there: deleting the bucket would lose them
        reason = f"kept: execution {', '.join(running)} of job {params['job_name']} has not ended"
        log.warning("Cleanup: bucket %s %s; delete it once it has ended", params["bucket"], reason)
        deleted = {"bucket": params["bucket"], "deleted": False, "objects_deleted": 0, "bytes_deleted": 0,
                   "reason": reason}
    elif params["delete_bucket"]:
        # [START howto_hook_delete_bucket]
        deleted = CheckpointBucketHook(gcp_conn_id=params["gcp_conn_id"]).delete_bucket_and_contents(
            bucket_name=params["bucket"], project_id=params["project_id"])
        # [END howto_hook_delete_bucket]
        log.info("Cleanup: bucket %s: %s objects, %s bytes deleted", deleted["bucket"], deleted["objects_deleted"],
                 deleted["bytes_deleted"])
    return {"job": result.action.value, "job_cleanup": result.to_dict(), "bucket": deleted}


# [START howto_dag_gpu_resilient_training]
with DAG(
    dag_id="gpu_resilient_training",
    description="Preemption-resilient PyTorch training on a Cloud Run GPU job",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    params={
        **common_params("gpu-resilient-training"),
        "delete_bucket": Param(False, type="boolean", description="Delete the bucket in cleanup"),
        "keep_job": Param(False, type="boolean", description="Keep the Cloud Run job in cleanup"),
        "cleanup_wait_seconds": Param(120, type="integer", minimum=0, maximum=3600,
                                      description="Seconds cleanup waits for a running execution to end "
                                                  "before keeping the job"),
    },
    user_defined_macros={"namespace_for": namespace_for},
    render_template_as_native_obj=True,
    tags=["gpu", "cloud-run", "example"],
) as dag:
    bucket = create_bucket()
    deploy = deploy_operator()
    execute = execute_operator()
    done = cleanup()
    check_job_is_ours() >> bucket >> grant_bucket_access() >> upload_dataset() >> deploy >> execute
    report(execute.output, namespace="{{ namespace_for(run_id) }}") >> done
    done.as_teardown(setups=bucket)
# [END howto_dag_gpu_resilient_training]
