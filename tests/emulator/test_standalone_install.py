"""``pip install ./emulator`` alone, no Airflow: its console script serves, and a plain
``google-cloud-run`` gRPC client, built as the emulator's README shows from
``CLOUD_RUN_EMULATOR_HOST``, runs a job of ``make demo``'s shape through it: a GPU, a
``cloud-storage`` volume, a task timeout, ``maxRetries`` 3. Task 0 trains with the worker; once it
has committed a checkpoint it is preempted through the admin endpoint; Cloud Run's retry resumes
from the checkpoint and the execution succeeds.

The environment is a real ``python -m venv`` into which this environment's pip installs only the
emulator's folder, copied away from the checkout (so that nothing but the folder itself builds the
wheel), pinned by ``constraints/dev.txt`` from the ordinary pip configuration. The image table maps
the job's image to the worker of the development environment (``python -m gpu_resilience_trainer``
with this interpreter, as ``worker/emulator-image.json`` does with the emulator's): the standalone
environment has no torch. The emulator runs from the new environment's ``cloud-run-emulator``
script; the client runs on the new environment's Python, from a file holding the README's code
block and the job.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

from cloud_run_emulator.process import OFFLINE_ENV, EmulatorProcess, post_json
from tests.worker.conftest import write_digits

REPO = Path(__file__).resolve().parents[2]
PROJECT, REGION, BUCKET = "local-project", "us-central1", "standalone-checkpoints"
IMAGE = "us-central1-docker.pkg.dev/local-project/ml/airflow-gpu-resilience-worker:latest"
STEPS, CHECKPOINT_EVERY = 400, 25

# A slow test (a venv, an install, a training run with a preemption and a grace period): it runs
# with the timing-sensitive tests, alone.
pytestmark = pytest.mark.serial

#: The client, run by the new environment's Python after the README's code block (``jobs``):
#: creates the job of argv[1] (JSON), runs it, prints the execution's name, waits for the
#: execution and prints its counts.
CLIENT = '''
import json, sys
from google.protobuf import duration_pb2

spec = json.loads(sys.argv[1])
container = run_v2.Container(
    image=spec["image"], args=spec["args"],
    env=[run_v2.EnvVar(name=k, value=v) for k, v in spec["env"].items()],
    resources=run_v2.ResourceRequirements(limits={"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}),
    volume_mounts=[run_v2.VolumeMount(name="checkpoint-volume", mount_path="/checkpoints")])
job = run_v2.Job(template=run_v2.ExecutionTemplate(task_count=1, template=run_v2.TaskTemplate(
    containers=[container], max_retries=3, timeout=duration_pb2.Duration(seconds=spec["timeout"]),
    node_selector=run_v2.NodeSelector(accelerator="nvidia-l4"), gpu_zonal_redundancy_disabled=True,
    volumes=[run_v2.Volume(name="checkpoint-volume", gcs=run_v2.GCSVolumeSource(bucket=spec["bucket"]))])))
created = jobs.create_job(parent=spec["parent"], job=job, job_id=spec["job_id"]).result(timeout=60)
operation = jobs.run_job(name=created.name)
print(json.dumps({"execution": operation.metadata.name}), flush=True)
execution = operation.result(timeout=600)
print(json.dumps({"succeeded": execution.succeeded_count, "failed": execution.failed_count,
                  "retried": execution.retried_count, "name": execution.name}), flush=True)
'''


def _clean_env() -> dict[str, str]:
    """This environment without what would lead the new one to the checkout or this venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
           and not k.startswith(("CLOUD_RUN_", "CHECKPOINT_", "STORAGE_EMULATOR_"))}
    return {**env, **OFFLINE_ENV}


def _install_emulator_alone(tmp_path: Path) -> Path:
    """A new venv with ``pip install`` of a copy of ``emulator/``; :return: its ``bin`` folder."""
    source = tmp_path / "src" / "emulator"
    shutil.copytree(REPO / "emulator", source, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(tmp_path / "venv")
    bin_dir = tmp_path / "venv" / "bin"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "--quiet", "--no-input",
         "--no-compile", "-c", str(REPO / "constraints" / "dev.txt"), str(source)],
        env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return bin_dir


def _readme_client_lines() -> str:
    """The emulator README's Python code block: the plain client from ``CLOUD_RUN_EMULATOR_HOST``."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "emulator" / "README.md").read_text(), re.S)
    assert len(blocks) == 1 and "CLOUD_RUN_EMULATOR_HOST" in blocks[0], blocks
    return blocks[0]


def _image_table(tmp_path: Path) -> Path:
    """The worker image as ``worker/emulator-image.json`` maps it, on this environment's Python."""
    table = tmp_path / "images.json"
    entry = {"entrypoint": [sys.executable, "-m", "gpu_resilience_trainer"], "cmd": ["train"],
             "cwd": str(REPO / "worker")}
    table.write_text(json.dumps({"images": {"*/airflow-gpu-resilience-worker:*": entry}}))
    return table


def _line(process: subprocess.Popen, limit: float) -> dict:
    """The client's next JSON line within ``limit`` seconds (a guard against a hang)."""
    readable, _, _ = select.select([process.stdout], [], [], limit)
    line = process.stdout.readline() if readable else ""
    if not line:  # its stderr says why; a client still running (a hang) is stopped to read it
        if process.poll() is None:
            process.kill()
        _, err = process.communicate(timeout=30)
        raise AssertionError(f"no line from the client within {limit:g} s (exit {process.returncode}): {err}")
    return json.loads(line)


def _wait_for(condition, what: str, limit: float = 240.0):
    deadline = time.monotonic() + limit
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} did not happen within {limit:g} s"
        time.sleep(0.1)
    return value


def test_the_emulator_installed_alone_runs_the_demo_job_shape_through_a_plain_grpc_client(tmp_path: Path) -> None:
    bin_dir = _install_emulator_alone(tmp_path)
    env = _clean_env()
    probe = subprocess.run([str(bin_dir / "python"), "-c", "import airflow"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'airflow'" in probe.stderr, probe.stderr
    probe = subprocess.run([str(bin_dir / "python"), "-c", (
        "import importlib.util as u, cloud_run_emulator as c\nprint(c.__file__)\n"
        "assert all(u.find_spec(n) is None for n in ('airflow_gpu_resilience', 'gpu_resilience_worker', 'torch'))")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0 and probe.stdout.startswith(str(tmp_path / "venv")), probe.stdout + probe.stderr

    data = tmp_path / "digits.npz"
    write_digits(data)
    client_file = tmp_path / "client.py"
    client_file.write_text(_readme_client_lines() + CLIENT)
    with EmulatorProcess(tmp_path / "emulator", images_file=_image_table(tmp_path), grace_seconds=5.0,
                         program=[str(bin_dir / "cloud-run-emulator")], env=env) as emulator:
        assert post_json(f"{emulator.gcs_endpoint}/storage/v1/b?project={PROJECT}", {"name": BUCKET})["name"] == BUCKET
        spec = {"parent": f"projects/{PROJECT}/locations/{REGION}", "job_id": "standalone-training", "image": IMAGE,
                "bucket": BUCKET, "timeout": 600,
                "env": {"CHECKPOINT_DIR": "/checkpoints", "TASK_TIMEOUT_SECONDS": "600"},
                "args": ["train", "--data", str(data), "--steps", str(STEPS), "--checkpoint-every",
                         str(CHECKPOINT_EVERY), "--step-delay", "0.05"]}
        client_env = {**env, "CLOUD_RUN_EMULATOR_HOST": emulator.grpc_endpoint}
        client = subprocess.Popen([str(bin_dir / "python"), str(client_file), json.dumps(spec)], cwd=tmp_path,
                                  env=client_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            execution = _line(client, 120)["execution"]
            namespace = emulator.bucket_dir(BUCKET) / "standalone-training" / "task-0"
            committed = _wait_for(lambda: sorted(namespace.glob("ckpt-*.commit.json")), "a committed checkpoint")
            first_step = int(committed[0].name.split("-")[1].split(".")[0])
            assert emulator.preempt(execution, 0)["attempt"] == 0
            result = _line(client, 600)
            assert client.wait(timeout=60) == 0, client.stderr.read()
        finally:
            if client.poll() is None:
                client.kill()
                client.wait()
            client.stdout.close()
            client.stderr.close()
        first, second = emulator.attempts(execution)
    assert result == {"succeeded": 1, "failed": 0, "retried": 1, "name": execution}
    assert (first["attempt"], first["stopReason"], first["exitCode"]) == (0, "preempted", 143)
    assert (second["attempt"], second["exitCode"]) == (1, 0)
    attempts = json.loads((namespace / "attempts.json").read_text())["attempts"]
    execution_id = execution.rsplit("/", 1)[-1]
    assert [(a["attempt"], a["execution"]) for a in attempts] == [(0, execution_id), (1, execution_id)]
    assert attempts[0]["resumed_from_step"] == 0 and attempts[1]["resumed_from_step"] >= first_step > 0, attempts
    assert json.loads((namespace / "metrics.json").read_text())["steps"] == STEPS
