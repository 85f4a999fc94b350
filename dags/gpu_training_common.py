"""Pieces shared by the example DAGs: their params, the dataset export and the report.

Not a DAG file itself (``.airflowignore`` keeps the DAG processor from parsing it); the DAG files
in this folder import it, since Airflow puts the DAGs folder on ``sys.path``.
"""

from __future__ import annotations

import hashlib
import io
import json
import re

from airflow.providers.common.compat.sdk import Param, task
from airflow.providers.google.cloud.hooks.gcs import GCSHook

from airflow_gpu_resilience.hooks.gcs import MANAGED_BY_LABEL, MANAGED_BY_VALUE, CheckpointBucketHook
from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuDeployJobOperator, CloudRunGpuExecuteJobOperator

#: Object name of the full dataset inside the checkpoint bucket: the worker's default ``--data``,
#: resolved against the mounted bucket.
DATASET_OBJECT = "data/digits.npz"

#: Default worker image; the emulator's image table (``worker/emulator-image.json``) maps any
#: ``*/airflow-gpu-resilience-worker:*`` image to ``python -m gpu_resilience_trainer``.
DEFAULT_IMAGE = "us-central1-docker.pkg.dev/local-project/ml/airflow-gpu-resilience-worker:latest"


def common_params(job_name: str, *, steps: int = 600) -> dict[str, Param]:
    """:return: the DAG params every example shares; defaults run against the emulators.

    :param job_name: default Cloud Run job name.
    :param steps: default number of optimizer steps.
    """
    return {
        "gcp_conn_id": Param("google_cloud_default", type="string", description="Airflow connection"),
        "project_id": Param("local-project", type="string", description="Google Cloud project"),
        "region": Param("us-central1", type="string", description="Cloud Run region with L4 GPUs"),
        "job_name": Param(job_name, type="string", pattern=r"^[a-z]([-a-z0-9]{0,47}[a-z0-9])?$"),
        "image": Param(DEFAULT_IMAGE, type="string", minLength=1, description="Worker image built from worker/, or your own (examples/user-image)"),
        # Cloud Storage bucket names: 3-63 of a-z 0-9 - _ . , starting and ending with a letter or digit.
        "bucket": Param("gpu-resilient-checkpoints", type="string", pattern=r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$",
                        description="Checkpoint bucket"),
        "service_account": Param("gpu-trainer@local-project.iam.gserviceaccount.com", type="string",
                                 description="Service account the job runs as"),
        "gpu_type": Param("nvidia-l4", enum=["nvidia-l4", "nvidia-rtx-pro-6000"]),
        "max_retries": Param(3, type="integer", minimum=0, maximum=10, description="Cloud Run retries per task"),
        "max_preemption_reruns": Param(3, type="integer", minimum=0,
                                       description="New executions allowed after preemptions"),
        "task_timeout_seconds": Param(4 * 3600, type="integer", minimum=1, maximum=168 * 3600,
                                      description="Per-attempt task timeout, seconds"),
        "poll_interval_seconds": Param(10.0, type="number", minimum=0.1,
                                       description="Seconds between execution polls"),
        "steps": Param(steps, type="integer", minimum=1, description="Optimizer steps to train"),
        "checkpoint_every": Param(50, type="integer", minimum=1, description="Steps between checkpoints"),
        "hidden_units": Param(128, type="integer", minimum=1, description="Hidden units per MLP layer"),
        "seed": Param(0, type="integer", minimum=0, maximum=2**63 - 1,
                      description="Training seed (same seed, same model)"),
        "step_delay_seconds": Param(0.0, type="number", minimum=0, maximum=3600,
                                    description="Artificial delay per step, seconds"),
        "preemption_save": Param("deadline", enum=["deadline", "always", "never"],
                                 description="Worker's checkpoint at a SIGTERM (never: resume from the last one)"),
        "log_container_output": Param(False, type="boolean",
                                      description="Copy the container's Cloud Logging lines into the task log"),
    }


#: The worker's training flags, rendered from the params above (``--flag=value`` stays a string
#: under ``render_template_as_native_obj``).
WORKER_ARGS = [
    "train",
    "--steps={{ params.steps }}",
    "--checkpoint-every={{ params.checkpoint_every }}",
    "--step-delay={{ params.step_delay_seconds }}",
    "--hidden={{ params.hidden_units }}",
    "--seed={{ params.seed }}",
    "--preemption-save={{ params.preemption_save }}",
]


@task
def create_bucket(params: dict | None = None) -> dict:
    """The checkpoint bucket: regional (in the job's region), standard class, labelled
    ``managed-by=airflow-gpu-resilience`` and ``gcp-project=<project_id>``.

    An existing bucket is used only if it is ours from an earlier run (that label, the same
    project); someone else's bucket fails this task, naming the bucket and what to do, before
    the grant, the upload or anything else touches it
    (:meth:`~airflow_gpu_resilience.hooks.gcs.CheckpointBucketHook.ensure_bucket`).

    :return: ``{"bucket", "created", "labels", "project_number"}``.
    :raises CheckpointBucketNotOursError: the bucket exists and is not ours.
    """
    # [START howto_hook_ensure_bucket]
    return CheckpointBucketHook(gcp_conn_id=params["gcp_conn_id"]).ensure_bucket(
        bucket_name=params["bucket"], project_id=params["project_id"], location=params["region"],
        storage_class="STANDARD",
    )
    # [END howto_hook_ensure_bucket]


#: Labels on the deployed Cloud Run job: deploy updates and cleanup deletes only a job that carries them.
JOB_LABELS = {MANAGED_BY_LABEL: MANAGED_BY_VALUE}


def job_is_ours(job) -> bool:
    """:return: whether a ``run_v2.Job`` carries ``JOB_LABELS`` (deployed by these DAGs, or adopted).

    :param job: the job as GetJob returns it.
    """
    return all(job.labels.get(key) == value for key, value in JOB_LABELS.items())


@task
def check_job_is_ours(params: dict | None = None) -> str:
    """Fail before any side effect when a Cloud Run job of the ``job_name`` param exists and is
    not ours (no ``managed-by=airflow-gpu-resilience`` label): deploying would overwrite someone
    else's job, and cleanup would delete it.

    :return: ``"absent"`` (deploy creates it) or ``"ours"`` (deploy updates it).
    :raises AirflowFailException: the job exists without our label; the message says what to do.
    """
    from airflow.providers.common.compat.sdk import AirflowFailException
    from google.api_core.exceptions import NotFound

    from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook

    name = params["job_name"]
    # [START howto_hook_get_job]
    try:
        job = CloudRunGpuHook(gcp_conn_id=params["gcp_conn_id"]).get_job(
            job_name=name, project_id=params["project_id"], region=params["region"])
    except NotFound:
        return "absent"
    # [END howto_hook_get_job]
    if not job_is_ours(job):
        raise AirflowFailException(
            f"Cloud Run job {name!r} already exists in {params['project_id']}/{params['region']} and is not this "
            f"deployment's: it has no label {MANAGED_BY_LABEL}={MANAGED_BY_VALUE} (its labels: {dict(job.labels)}). "
            f"Nothing was changed. Choose another `job_name` param, or, to let these DAGs redeploy and delete it, "
            f"label it: gcloud run jobs update {name} --region {params['region']} "
            f"--update-labels={MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"
        )
    return "ours"


def deploy_operator(image: str = "{{ params.image }}") -> CloudRunGpuDeployJobOperator:
    """:return: the ``deploy_job`` task: the GPU job from the params (L4 by default, no zonal
    redundancy, task timeout, max retries, service account, the bucket mounted at
    ``/checkpoints``), labelled ``JOB_LABELS``; deploying an unchanged spec changes nothing.

    :param image: the image (templated): the ``image`` param by default; the build-from-source
        DAG passes the digest its build pushed.
    """
    # [START howto_operator_deploy_job]
    return CloudRunGpuDeployJobOperator(
        task_id="deploy_job",
        gcp_conn_id="{{ params.gcp_conn_id }}",
        project_id="{{ params.project_id }}",
        region="{{ params.region }}",
        job_name="{{ params.job_name }}",
        image=image,
        args=WORKER_ARGS,
        gpu_type="{{ params.gpu_type }}",
        task_timeout="{{ params.task_timeout_seconds }}",
        max_retries="{{ params.max_retries }}",
        service_account="{{ params.service_account }}",
        checkpoint_bucket="{{ params.bucket }}",
        labels=JOB_LABELS,
    )
    # [END howto_operator_deploy_job]


#: Execution overrides that give each DAG run its own checkpoint namespace: the worker then keeps
#: ``{job}/{namespace_for(run_id)}/task-{i}/`` in the bucket, so a cleared task resumes its own
#: run's checkpoints and a new DAG run (other params, another day) never resumes another's.
# [START howto_run_namespace]
RUN_NAMESPACE_OVERRIDES = {
    "container_overrides": [{"env": [{"name": "CHECKPOINT_RUN_ID", "value": "{{ namespace_for(run_id) }}"}]}]
}

#: Where that namespace's task folders are in the bucket (the execute operator's ``checkpoint_prefix``).
RUN_CHECKPOINT_PREFIX = "{{ params.job_name }}/{{ namespace_for(run_id) }}"
# [END howto_run_namespace]


def execute_operator(task_id: str = "execute_job", **kwargs) -> CloudRunGpuExecuteJobOperator:
    """:return: the execute task for the params' job: preemption-aware, deferrable, with the
    run's own checkpoint namespace (``RUN_NAMESPACE_OVERRIDES``), progress and lost work read
    from the bucket. ``kwargs`` override or add operator arguments (``overrides``,
    ``wait_for_completion``, ...)."""
    # [START howto_operator_execute_job]
    arguments = {
        "gcp_conn_id": "{{ params.gcp_conn_id }}",
        "project_id": "{{ params.project_id }}",
        "region": "{{ params.region }}",
        "job_name": "{{ params.job_name }}",
        "max_preemption_reruns": "{{ params.max_preemption_reruns }}",
        "overrides": RUN_NAMESPACE_OVERRIDES,
        "checkpoint_bucket": "{{ params.bucket }}",
        "checkpoint_prefix": RUN_CHECKPOINT_PREFIX,
        "poll_interval": "{{ params.poll_interval_seconds }}",
        "log_container_output": "{{ params.log_container_output }}",
        **kwargs,
    }
    return CloudRunGpuExecuteJobOperator(task_id=task_id, **arguments)
    # [END howto_operator_execute_job]


def namespace_for(run_id: str) -> str:
    """A checkpoint namespace (the worker's ``CHECKPOINT_RUN_ID``) for one DAG run.

    :param run_id: Airflow run id, e.g. ``scheduled__2026-01-01T00:00:00+00:00``.
    :return: ``[a-z0-9-]`` only, at most 63 characters, stable for the same run id.
    """
    slug = re.sub(r"[^a-z0-9]+", "-", run_id.lower()).strip("-")
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    return f"{slug[:54]}-{digest}"


# [START howto_dataset_digits_npz]
def digits_npz(partition: str | None = None) -> bytes:
    """scikit-learn's handwritten-digits set as ``.npz`` bytes (``x_train``, ``y_train``, ``x_test``,
    ``y_test``; ``x`` float32 [N, 64] in [0, 1], ``y`` int64 [N]).

    :param partition: ``None`` for the fixed 80/20 stratified split; a partition key (a date)
        for that day's share of the training data: a deterministic 80% sample keyed by it,
        standing in for data that lands daily. The test split never changes.
    """
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    if partition is not None:
        seed = int(hashlib.sha256(partition.encode()).hexdigest()[:8], 16)
        keep = np.random.default_rng(seed).permutation(len(x_train))[: int(0.8 * len(x_train))]
        x_train, y_train = x_train[np.sort(keep)], y_train[np.sort(keep)]
    buffer = io.BytesIO()
    np.savez(buffer, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return buffer.getvalue()
# [END howto_dataset_digits_npz]


@task
def grant_bucket_access(params: dict | None = None) -> None:
    """Grant the job's service account ``roles/storage.objectAdmin`` on the checkpoint bucket only.

    The binding goes into the bucket's IAM policy (not the project's), so the job can read and
    write its checkpoints and nothing else. An existing binding is left as it is.
    """
    bucket = GCSHook(gcp_conn_id=params["gcp_conn_id"]).get_conn().bucket(params["bucket"])
    policy = bucket.get_iam_policy(requested_policy_version=3)
    member = f"serviceAccount:{params['service_account']}"
    for binding in policy.bindings:
        if binding["role"] == "roles/storage.objectAdmin" and member in binding["members"]:
            return
    policy.bindings.append({"role": "roles/storage.objectAdmin", "members": {member}})
    bucket.set_iam_policy(policy)


# [START howto_dataset_upload]
@task
def upload_dataset(object_name: str = DATASET_OBJECT, partition: str | None = None,
                   params: dict | None = None) -> str:
    """Upload the digits set (see :func:`digits_npz`) unless the object is already there.

    :param object_name: object name in the checkpoint bucket.
    :param partition: the day's partition key, or ``None`` for the full set.
    :return: the object's ``gs://`` URI.
    """
    gcs = GCSHook(gcp_conn_id=params["gcp_conn_id"])
    if not gcs.exists(bucket_name=params["bucket"], object_name=object_name):
        gcs.upload(bucket_name=params["bucket"], object_name=object_name, data=digits_npz(partition))
    return f"gs://{params['bucket']}/{object_name}"
# [END howto_dataset_upload]


@task
def report(summary: dict, namespace: str = "", params: dict | None = None) -> dict:
    """Read each task's ``metrics.json`` from the bucket and log what the run achieved.

    :param summary: the execute operator's summary (its ``return_value`` XCom).
    :param namespace: the run's checkpoint namespace (``CHECKPOINT_RUN_ID``), ``""`` for none.
    :return: ``{"tasks": [per task: accuracy, steps, attempts, lost_steps], "executions": [...],
        "preemptions": [...]}``.
    """
    gcs = GCSHook(gcp_conn_id=params["gcp_conn_id"])
    prefix = "/".join(part for part in (params["job_name"], namespace) if part)
    tasks = []
    for index in range(int(summary.get("task_count", 1))):
        metrics = json.loads(gcs.download(bucket_name=params["bucket"], object_name=f"{prefix}/task-{index}/metrics.json"))
        attempts = metrics.get("attempts") or metrics.get("history", [])
        lost = sum(int(a.get("lost_steps", 0)) for a in attempts)
        print(f"task {index}: held-out accuracy {metrics['accuracy']:.4f} after {metrics['steps']} steps, "
              f"{len(attempts)} attempt(s), {lost} step(s) of work lost")
        tasks.append({"index": index, "accuracy": metrics["accuracy"], "steps": metrics["steps"],
                      "attempts": len(attempts), "lost_steps": lost})
    executions = [e.get("name") for e in summary.get("executions", [])]
    print(f"{len(executions)} execution(s), {len(summary.get('preemptions', []))} preemption(s) seen")
    return {"tasks": tasks, "executions": executions, "preemptions": summary.get("preemptions", [])}
