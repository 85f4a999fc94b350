"""The documentation's examples under ``docs/examples/`` do what their pages say.

- ``dags/minimal_dag.py`` (README.md and "Getting started"): ``airflow dags test`` against the
  Cloud Run and GCS emulators deploys the job and trains it to the end;
- ``connections.py`` ("Connection"): each set-up sends the provider's hook where the page says;
- ``emulator_clients.py`` ("Emulator"): the unmodified clients reach the emulator over REST and gRPC;
- ``emulator_run.py`` ("Getting started", "Troubleshooting", "Emulator"): the bucket the minimal DAG
  needs, a label that adopts a bucket, and a preemption of the newest running execution.

The worker examples run in ``tests/worker`` (``test_readme_example.py`` and the framework tests),
the goodput example in ``tests/unit/test_docs.py``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
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


def _emulator_run():
    """``docs/examples/emulator_run.py``, with ``dags/`` importable as the page says it must be."""
    if str(REPO / "dags") not in sys.path:
        sys.path.insert(0, str(REPO / "dags"))
    return _load(EXAMPLES / "emulator_run.py", "emulator_run_example")


@pytest.mark.e2e
def test_the_minimal_dag_deploys_and_trains_to_the_end(tmp_path: Path) -> None:
    """The README's DAG, unchanged, with a bucket holding the digits set: both tasks succeed and the
    worker's metrics say it trained the 600 steps of its args in the job's task folder."""
    from cloud_run_emulator.process import EmulatorProcess

    demo = _load(REPO / "scripts" / "demo.py", "agr_demo_for_docs")
    dag = _load(EXAMPLES / "dags" / "minimal_dag.py", "minimal_dag")
    with EmulatorProcess(tmp_path / "emulator", images_file=REPO / "worker" / "emulator-image.json") as emulator:
        _emulator_run().prepare_bucket(emulator.gcs_endpoint, dag.PROJECT, dag.BUCKET)
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


def test_the_emulator_run_example_labels_a_bucket_and_preempts_the_newest_running_execution(tmp_path: Path) -> None:
    """``label_as_ours`` adds the label and keeps the others; ``preempt_newest_running`` finds the
    running one of two executions by the job name alone and preempts its task (the emulator
    records the attempt as preempted)."""
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import run_v2, storage

    from cloud_run_emulator.process import EmulatorProcess

    example = _emulator_run()
    table = tmp_path / "images.json"
    table.write_text(json.dumps({"images": {"example.com/sleeper:1": {
        "entrypoint": ["{python}", "-c", "import time; time.sleep(600)"]}}}))
    with EmulatorProcess(tmp_path / "emulator", images_file=table) as emulator:
        client = storage.Client(project="my-project", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": emulator.gcs_endpoint})
        bucket = client.create_bucket("someone-elses-bucket")
        bucket.labels = {"team": "vision"}
        bucket.patch()
        example.label_as_ours(emulator.gcs_endpoint, "my-project", "someone-elses-bucket")
        assert client.get_bucket("someone-elses-bucket").labels == {"team": "vision",
                                                                    "managed-by": "airflow-gpu-resilience"}

        jobs = run_v2.JobsClient(credentials=AnonymousCredentials(), transport="rest",
                                 client_options=ClientOptions(api_endpoint=emulator.endpoint))
        job = run_v2.Job(template=run_v2.ExecutionTemplate(template=run_v2.TaskTemplate(
            containers=[run_v2.Container(image="example.com/sleeper:1")], max_retries=1)))
        jobs.create_job(parent=PARENT, job=job, job_id="sleeper").result()
        with pytest.raises(LookupError, match="no execution of job 'sleeper'"):
            example.preempt_newest_running(emulator.endpoint, "local-project", "us-central1", "sleeper")
        first = jobs.run_job(name=f"{PARENT}/jobs/sleeper").metadata.name
        executions = run_v2.ExecutionsClient(credentials=AnonymousCredentials(), transport="rest",
                                             client_options=ClientOptions(api_endpoint=emulator.endpoint))
        executions.cancel_execution(name=first).result()
        newest = jobs.run_job(name=f"{PARENT}/jobs/sleeper").metadata.name
        answer = None
        for _ in range(600):  # until its task process runs (or 60 s pass)
            try:
                answer = example.preempt_newest_running(emulator.endpoint, "local-project", "us-central1", "sleeper")
                break
            except LookupError:
                time.sleep(0.1)
        assert answer is not None and answer["task"] == f"{newest}/tasks/{newest.rsplit('/', 1)[1]}-task0", answer
        for _ in range(600):  # the preempted attempt ends after the grace period
            if emulator.attempts(newest):
                break
            time.sleep(0.1)
        [attempt] = emulator.attempts(newest)
        assert attempt["stopReason"] == "preempted", attempt
