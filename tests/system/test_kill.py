"""Killing the Airflow task cancels its Cloud Run execution: no orphaned, billed GPU task.

Airflow kills a running task with SIGTERM; the task runner then calls the operator's
``on_kill``. This drives that for real: the example DAG runs under ``airflow dags test`` against
the emulators, and while the worker trains, the Airflow process gets SIGTERM.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import run_v2

from cloud_run_emulator.process import EmulatorProcess

REPO = Path(__file__).resolve().parents[2]
JOB = "projects/local-project/locations/us-central1/jobs/gpu-resilient-training"

pytestmark = pytest.mark.e2e


def _load_demo():
    spec = importlib.util.spec_from_file_location("agr_demo_kill", REPO / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_sigterm_to_the_airflow_task_cancels_the_execution(tmp_path: Path) -> None:
    demo = _load_demo()
    with EmulatorProcess(tmp_path / "emulator", images_file=REPO / "worker" / "emulator-image.json") as emulator:
        options = ClientOptions(api_endpoint=emulator.endpoint)
        jobs = run_v2.JobsClient(credentials=AnonymousCredentials(), transport="rest", client_options=options)
        executions = run_v2.ExecutionsClient(credentials=AnonymousCredentials(), transport="rest",
                                             client_options=options)
        env = demo.airflow_env(tmp_path, emulator)
        airflow = str(Path(sys.executable).with_name("airflow"))
        subprocess.run([airflow, "db", "migrate"], env=env, check=True, capture_output=True)
        conf = {"steps": 5000, "step_delay_seconds": 0.05, "poll_interval_seconds": 0.5}
        with (tmp_path / "dags-test.log").open("w") as log:
            process = subprocess.Popen([airflow, "dags", "test", "gpu_resilient_training", "--conf", json.dumps(conf)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            job_folder = emulator.bucket_dir("gpu-resilient-checkpoints") / "gpu-resilient-training"
            _wait_for(lambda: list(job_folder.glob("*/task-0/progress.json")), 240, "the worker to make progress")
            name = jobs.get_job(name=JOB).latest_created_execution.name
            process.send_signal(signal.SIGTERM)
            cancelled = _wait_for(lambda: executions.get_execution(name=name).cancelled_count, 60,
                                  "the execution to be cancelled")
            assert cancelled == 1
            assert process.wait(timeout=120) != 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    log_text = (tmp_path / "dags-test.log").read_text()
    assert "Cancelling execution" in log_text
