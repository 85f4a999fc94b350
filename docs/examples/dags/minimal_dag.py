"""The smallest DAG: deploy a Cloud Run GPU job, then run it to the end through preemptions.

README.md and the "Getting started" page show it; ``tests/system/test_docs_examples.py`` runs it
with ``airflow dags test`` against the Cloud Run and GCS emulators (the bucket made beforehand,
holding the digits set at ``data/digits.npz``, the bundled worker's default ``--data``).
"""

# [START howto_minimal_dag]
from airflow.sdk import DAG

from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuDeployJobOperator, CloudRunGpuExecuteJobOperator

PROJECT, REGION = "my-project", "us-central1"
JOB, BUCKET = "digits-training", "my-checkpoint-bucket"

with DAG("minimal_gpu_training", schedule=None):
    deploy = CloudRunGpuDeployJobOperator(
        task_id="deploy_job",
        project_id=PROJECT,
        region=REGION,
        job_name=JOB,
        image="us-central1-docker.pkg.dev/my-project/ml/airflow-gpu-resilience-worker:latest",
        args=["train", "--steps=600", "--checkpoint-every=50"],
        service_account="gpu-trainer@my-project.iam.gserviceaccount.com",
        checkpoint_bucket=BUCKET,  # mounted at /checkpoints: the worker commits its checkpoints there
        task_timeout=3600,  # seconds per attempt; the worker checkpoints and exits 143 before it
        max_retries=3,  # Cloud Run's own retries of a task, preemptions included
    )
    execute = CloudRunGpuExecuteJobOperator(
        task_id="execute_job",
        project_id=PROJECT,
        region=REGION,
        job_name=JOB,
        checkpoint_bucket=BUCKET,  # progress, lost work and the re-run budget come from the checkpoints
    )
    deploy >> execute
# [END howto_minimal_dag]
