"""The documentation's examples under ``docs/examples/`` do what their pages say.

- ``dags/minimal_dag.py`` (README.md and "Getting started"): ``airflow dags test`` against the
  Cloud Run and GCS emulators deploys the job and trains it to the end;
- ``connections.py`` ("Connection"): each set-up sends the provider's hook where the page says;
- ``emulator_clients.py`` ("Emulator"): the unmodified clients reach the emulator over REST and gRPC.

The worker examples run in ``tests/worker`` (``test_readme_example.py`` and the framework tests),
the goodput example in ``tests/unit/test_docs.py``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "docs" / "examples"
PARENT = "projects/local-project/locations/us-central1"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.e2e
def test_the_minimal_dag_deploys_and_trains_to_the_end(tmp_path: Path) -> None:
    """The README's DAG, unchanged, with a bucket holding the digits set: both tasks succeed and the
    worker's metrics say it trained the 600 steps of its args in the job's task folder."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from cloud_run_emulator.process import EmulatorProcess

    sys.path.insert(0, str(REPO / "dags"))
    from gpu_training_common import DATASET_OBJECT, digits_npz

    demo = _load(REPO / "scripts" / "demo.py", "agr_demo_for_docs")
    dag = _load(EXAMPLES / "dags" / "minimal_dag.py", "minimal_dag")
    with EmulatorProcess(tmp_path / "emulator", images_file=REPO / "worker" / "emulator-image.json") as emulator:
        client = storage.Client(project=dag.PROJECT, credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": emulator.gcs_endpoint})
        client.create_bucket(dag.BUCKET).blob(DATASET_OBJECT).upload_from_string(digits_npz())
        env = {**demo.airflow_env(tmp_path, emulator), "AIRFLOW__CORE__DAGS_FOLDER": str(EXAMPLES / "dags")}
        log = tmp_path / "minimal_dag.log"
        rc = demo.run_dag(env, {}, log, dag_id="minimal_gpu_training")
        assert rc == 0, log.read_text()[-6000:]
        metrics = json.loads((emulator.bucket_dir(dag.BUCKET) / dag.JOB / "task-0" / "metrics.json").read_text())
    assert metrics["steps"] == 600 and metrics["accuracy"] > 0.8


def test_each_connection_example_sends_the_hook_where_the_page_says(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """REST through ``api_endpoint``, gRPC through ``CLOUD_RUN_EMULATOR_HOST`` (both list jobs on a
    running emulator), and Google's endpoint with a key file and no endpoint."""
    from cloud_run_emulator.process import EmulatorProcess
    from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook

    examples = _load(EXAMPLES / "connections.py", "connection_examples")
    for name in ("AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT", "STORAGE_EMULATOR_HOST", "CLOUD_RUN_EMULATOR_HOST"):
        monkeypatch.setenv(name, "")  # restored after the test, whatever the examples set
    monkeypatch.delenv("CLOUD_RUN_EMULATOR_HOST")
    with EmulatorProcess(tmp_path / "emulator") as emulator:
        examples.emulator_over_rest(emulator.endpoint, emulator.gcs_endpoint)
        hook = CloudRunGpuHook()
        assert (hook.transport, hook.api_endpoint) == ("rest", emulator.endpoint)
        assert list(hook.jobs_client("us-central1").list_jobs(parent=PARENT)) == []

        examples.emulator_over_grpc(emulator.grpc_endpoint, emulator.gcs_endpoint)
        hook = CloudRunGpuHook()
        assert hook.transport == "grpc" and hook.project_id == "local-project"
        assert list(hook.jobs_client("us-central1").list_jobs(parent=PARENT)) == []

    monkeypatch.delenv("CLOUD_RUN_EMULATOR_HOST")
    examples.cloud_run("/secrets/key.json")
    hook = CloudRunGpuHook()
    assert (hook.transport, hook.api_endpoint) == (None, None)  # Google's endpoint, the clients' default transport
    assert (hook._get_field("project"), hook._get_field("key_path")) == ("my-project", "/secrets/key.json")


def test_the_emulator_clients_example_reaches_the_emulator_over_rest_and_grpc() -> None:
    result = subprocess.run([sys.executable, str(EXAMPLES / "emulator_clients.py")], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("REST: http://127.0.0.1:") and " gRPC: 127.0.0.1:" in lines[0]
    assert lines[1:] == ["jobs over REST: []", "jobs over gRPC: []", "buckets: ['my-checkpoint-bucket']"]
