"""What running a DAG of one's own against the emulator needs around it (the "Getting started",
"Troubleshooting" and "Emulator" pages show the parts between the markers).

- :func:`prepare_bucket`: the checkpoint bucket the deploy operator mounts must exist, and the
  bundled worker reads its data from ``data/digits.npz`` in it;
- :func:`label_as_ours`: label an existing bucket as this deployment's (``gcloud`` cannot reach
  the emulator);
- :func:`preempt_newest_running`: a maintenance preemption of the job's newest running execution,
  for example one an ``airflow dags test`` started.

``tests/system/test_docs_examples.py`` runs :func:`prepare_bucket` before the minimal DAG, and the
other two against a running emulator. ``digits_npz`` comes from ``dags/gpu_training_common.py``
(needs numpy and scikit-learn: the package's ``examples`` extra), so ``dags/`` must be importable.
"""

from __future__ import annotations

# [START howto_emulator_prepare_bucket]
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from gpu_training_common import DATASET_OBJECT, digits_npz  # dags/gpu_training_common.py


def prepare_bucket(gcs_endpoint: str, project: str, bucket_name: str) -> None:
    """Create the checkpoint bucket in the GCS emulator (STORAGE_EMULATOR_HOST, or the ready
    line's gcsEndpoint) and upload the bundled worker's data set to data/digits.npz."""
    client = storage.Client(project=project, credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": gcs_endpoint})
    bucket = client.create_bucket(bucket_name)
    bucket.blob(DATASET_OBJECT).upload_from_string(digits_npz())
# [END howto_emulator_prepare_bucket]


# [START howto_emulator_label_bucket]
def label_as_ours(gcs_endpoint: str, project: str, bucket_name: str) -> None:
    """Adopt an existing bucket: the label the example DAGs' ensure_bucket looks for."""
    client = storage.Client(project=project, credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": gcs_endpoint})
    bucket = client.get_bucket(bucket_name)
    bucket.labels = {**bucket.labels, "managed-by": "airflow-gpu-resilience"}
    bucket.patch()
# [END howto_emulator_label_bucket]


# [START howto_emulator_preempt_newest]
import json
import urllib.request

from google.api_core.client_options import ClientOptions
from google.cloud import run_v2


def preempt_newest_running(endpoint: str, project: str, region: str, job: str, task_index: int = 0) -> dict:
    """Preempt task ``task_index`` of the job's newest running execution; endpoint: the ready
    line's REST ``endpoint``. :return: the emulator's answer, ``{"task", "attempt", "pid"}``."""
    executions = run_v2.ExecutionsClient(credentials=AnonymousCredentials(), transport="rest",
                                         client_options=ClientOptions(api_endpoint=endpoint))
    running = [execution for execution in
               executions.list_executions(parent=f"projects/{project}/locations/{region}/jobs/{job}")
               if execution.running_count > 0]
    if not running:
        raise LookupError(f"no execution of job {job!r} has a running task")
    name = max(running, key=lambda execution: execution.create_time).name  # projects/.../executions/E
    request = urllib.request.Request(f"{endpoint}/_emulator/preempt", method="POST",
                                     data=json.dumps({"execution": name, "taskIndex": task_index}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as answer:
        return json.load(answer)
# [END howto_emulator_preempt_newest]
