"""Build the worker image from source with Cloud Build, train on Cloud Run GPUs, and tear it all down.

The whole workflow of ``gcloud beta run jobs deploy --source=.`` as a DAG, with cleanup:

check_job_is_ours -> ensure_repository -> create_bucket -> grant_bucket_access -> upload_dataset
-> upload_source -> build_image -> image_reference -> deploy_job -> execute_job -> report, and
teardown as the teardown of the repository and the bucket (it runs after failures too):

- ``ensure_repository``: first checks the ``source_dir`` param (a folder holding a
  ``Dockerfile``; else the task fails naming it, before anything is made), then the Artifact
  Registry Docker repository of the ``repository`` param, created labelled
  ``managed-by=airflow-gpu-resilience`` when missing; one that exists without that label is
  someone else's: the task fails before anything is created or uploaded;
- ``upload_source``: the ``source_dir`` folder (the bundled ``worker/`` by default) as a
  ``.tar.gz`` in the bucket, files its ``.dockerignore`` names left out;
- ``build_image``: the google provider's ``CloudBuildCreateBuildOperator``: ``docker build`` of
  that archive, pushed as ``REGION-docker.pkg.dev/PROJECT/REPOSITORY/IMAGE:<run namespace>``,
  the build's log in the bucket (``build-logs/``); a failed build fails the task and nothing is
  deployed;
- ``image_reference``: the pushed image by digest (``...@sha256:...``), which ``deploy_job``
  deploys, so a re-run or a later build never changes what this run trains with;
- ``execute_job``, ``report``: as in ``gpu_resilient_training``;
- ``teardown``: deletes the job (ours and idle), the bucket (ours), this run's image tag, the
  image version when no other tag names it (another build of the same source pushes the same
  digest), and the repository when it is ours and holds no other image; it reports each.

With the local emulator (``serve --google-endpoint``: Cloud Build and Artifact Registry are
reached on their default endpoints through its proxy) the DAG runs on a laptop; with a
connection to real Google Cloud the same file builds with Cloud Build (see the README's roles).
"""

from __future__ import annotations

import hashlib
import logging

import pendulum
from airflow.providers.common.compat.sdk import DAG, AirflowFailException, Param, task
from airflow.providers.google.cloud.hooks.gcs import GCSHook
from airflow.providers.google.cloud.operators.cloud_build import CloudBuildCreateBuildOperator

from gpu_training_build import (
    WORKER_SOURCE,
    ArtifactRepositoryHook,
    RepositoryNotOursError,
    SourceFolderError,
    built_image,
    check_source_folder,
    image_uri,
    source_archive,
)
from gpu_training_common import (
    check_job_is_ours,
    common_params,
    create_bucket,
    deploy_operator,
    execute_operator,
    grant_bucket_access,
    namespace_for,
    report,
    upload_dataset,
)

from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.exceptions import CheckpointBucketNotOursError
from airflow_gpu_resilience.hooks.gcs import CheckpointBucketHook
from airflow_gpu_resilience.job_cleanup import JobCleanupAction

log = logging.getLogger(__name__)

#: Where the build pushes: this run's tag of the image in the repository.
IMAGE_TAG = ("{{ params.region }}-docker.pkg.dev/{{ params.project_id }}/{{ params.repository }}/"
             "{{ params.image_name }}:{{ namespace_for(run_id) }}")


def _tag(params: dict, run_id: str) -> str:
    uri = image_uri(params["project_id"], params["region"], params["repository"], params["image_name"])
    return f"{uri}:{namespace_for(run_id)}"


@task
def ensure_repository(params: dict | None = None) -> dict:
    """The Artifact Registry repository, created labelled ours when missing, after the
    ``source_dir`` param is checked (the first task that makes anything: a bad folder fails here,
    before the repository or the bucket exists).

    :return: ``{"repository", "created"}``.
    :raises AirflowFailException: ``source_dir`` cannot be built (see :func:`check_source_folder`),
        or the repository exists and is not ours (nothing was changed).
    """
    try:
        check_source_folder(params["source_dir"])
        return ArtifactRepositoryHook(gcp_conn_id=params["gcp_conn_id"]).ensure_repository(
            project_id=params["project_id"], region=params["region"], repository=params["repository"])
    except (SourceFolderError, RepositoryNotOursError) as error:
        raise AirflowFailException(str(error)) from error


@task
def upload_source(params: dict | None = None, run_id: str | None = None) -> str:
    """Upload ``source_dir`` as a ``.tar.gz`` build context to the bucket.

    :return: the object's name.
    :raises AirflowFailException: the folder is missing or has no Dockerfile.
    """
    try:
        data = source_archive(params["source_dir"])
    except SourceFolderError as error:
        raise AirflowFailException(str(error)) from error
    name = f"source/{namespace_for(run_id)}/{hashlib.sha256(data).hexdigest()[:16]}.tar.gz"
    GCSHook(gcp_conn_id=params["gcp_conn_id"]).upload(bucket_name=params["bucket"], object_name=name, data=data)
    log.info("Uploaded %s (%d bytes) as gs://%s/%s", params["source_dir"], len(data), params["bucket"], name)
    return name


def build_operator() -> CloudBuildCreateBuildOperator:
    """:return: the ``build_image`` task: docker build of the uploaded source, pushed as :data:`IMAGE_TAG`."""
    # [START howto_operator_cloud_build_from_source]
    return CloudBuildCreateBuildOperator(
        task_id="build_image",
        gcp_conn_id="{{ params.gcp_conn_id }}",
        project_id="{{ params.project_id }}",
        location="{{ params.region }}",
        build={
            "source": {"storage_source": {"bucket": "{{ params.bucket }}",
                                          "object_": "{{ ti.xcom_pull(task_ids='upload_source') }}"}},
            "steps": [{"name": "gcr.io/cloud-builders/docker", "args": ["build", "-t", IMAGE_TAG, "."]}],
            "images": [IMAGE_TAG],
            "logs_bucket": "gs://{{ params.bucket }}/build-logs",
        },
    )
    # [END howto_operator_cloud_build_from_source]


@task
def image_reference(build: dict, params: dict | None = None, run_id: str | None = None) -> str:
    """:return: the image the build pushed, by digest (``...IMAGE@sha256:HEX``)."""
    reference = built_image(build, _tag(params, run_id))
    log.info("Built %s (build %s)", reference, build.get("id"))
    return reference


def _delete_bucket(params: dict, job_action: JobCleanupAction) -> dict:
    if job_action in (JobCleanupAction.KEEP_RUNNING, JobCleanupAction.KEEP_REQUESTED):
        return {"bucket": params["bucket"], "deleted": False, "reason": "kept: the job is kept"}
    try:
        return CheckpointBucketHook(gcp_conn_id=params["gcp_conn_id"]).delete_bucket_and_contents(
            bucket_name=params["bucket"], project_id=params["project_id"])
    except CheckpointBucketNotOursError as error:
        log.warning("Teardown: %s", error)
        return {"bucket": params["bucket"], "deleted": False, "reason": "not ours, kept"}


@task
def teardown(params: dict | None = None, ti=None, run_id: str | None = None) -> dict:
    """Delete what this run made: the job (ours, no execution running), the bucket (ours), the
    image this run pushed, and the repository when it is ours and empty; log and return each.

    :return: ``{"job", "bucket", "images", "repository"}``.
    """
    job = CloudRunGpuHook(gcp_conn_id=params["gcp_conn_id"]).delete_job_when_idle(
        job_name=params["job_name"], project_id=params["project_id"], region=params["region"],
        keep_job=False, wait_seconds=params["cleanup_wait_seconds"],
        poll_interval=min(5.0, params["poll_interval_seconds"]))
    log.info("Teardown: job %s: %s", params["job_name"], job.action.value)
    bucket = _delete_bucket(params, job.action)
    log.info("Teardown: bucket %s: %s", params["bucket"], bucket)
    registry = ArtifactRepositoryHook(gcp_conn_id=params["gcp_conn_id"])
    build = ti.xcom_pull(task_ids="build_image") or {}
    tag = _tag(params, run_id)
    pushed = [image for image in build.get("results", {}).get("images", []) if image.get("name") == tag]
    images = registry.delete_run_image(tag, pushed[0]["digest"]) if pushed else []
    log.info("Teardown: images deleted: %s", images or "none")
    repository = registry.delete_repository_if_ours_and_empty(
        project_id=params["project_id"], region=params["region"], repository=params["repository"])
    log.info("Teardown: repository %s: %s", params["repository"], repository)
    return {"job": job.action.value, "bucket": bucket, "images": images, "repository": repository}


with DAG(
    dag_id="gpu_training_from_source",
    description="Build the worker image with Cloud Build, train on a Cloud Run GPU job, delete everything",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    params={
        **common_params("gpu-training-from-source"),
        "bucket": Param("gpu-training-from-source", type="string", pattern=r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$",
                        description="Checkpoint and source bucket (deleted by the teardown)"),
        "repository": Param("gpu-training", type="string", pattern=r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$",
                            description="Artifact Registry Docker repository (created when missing)"),
        "image_name": Param("airflow-gpu-resilience-worker", type="string", pattern=r"^[a-z0-9][a-z0-9._/-]*$",
                            description="Image name inside the repository"),
        "source_dir": Param(WORKER_SOURCE, type="string", minLength=1,
                            description="Folder with a Dockerfile to build (on the Airflow worker)"),
        "cleanup_wait_seconds": Param(120, type="integer", minimum=0, maximum=3600,
                                      description="Seconds the teardown waits for a running execution to end"),
    },
    user_defined_macros={"namespace_for": namespace_for},
    render_template_as_native_obj=True,
    tags=["gpu", "cloud-run", "cloud-build", "example"],
) as dag:
    repository = ensure_repository()
    bucket = create_bucket()
    build = build_operator()
    reference = image_reference(build.output)
    execute = execute_operator()
    done = teardown()
    check_job_is_ours() >> repository >> bucket >> grant_bucket_access() >> upload_dataset() >> upload_source() >> build
    reference >> deploy_operator(image="{{ ti.xcom_pull(task_ids='image_reference') }}") >> execute
    report(execute.output, namespace="{{ namespace_for(run_id) }}") >> done
    done.as_teardown(setups=[repository, bucket])
