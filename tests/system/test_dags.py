"""The example DAGs: they import cleanly, render the Job gcloud would deploy, and run.

The rendering tests load the DAG files unchanged from ``dags/`` and render their templates with
the default params, as Airflow does at run time; the run tests drive ``airflow dags test``
against the Cloud Run and GCS emulators with the bundled worker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from google.cloud import run_v2
from google.protobuf import json_format

REPO = Path(__file__).resolve().parents[2]
DAGS = REPO / "dags"
sys.path.insert(0, str(DAGS))

SA = "gpu-trainer@local-project.iam.gserviceaccount.com"
IMAGE = "us-central1-docker.pkg.dev/local-project/ml/airflow-gpu-resilience-worker:latest"


def _dagbag():
    from tests.airflow_compat import DagBag

    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    return bag


def _rendered(dag_id: str, task_id: str, **context):
    from tests.airflow_compat import DagBag

    dag = DagBag(dag_folder=str(DAGS / f"{dag_id}.py")).dags[dag_id]
    task = dag.get_task(task_id)
    task.render_template_fields({"params": dag.params.dump(), **context}, jinja_env=dag.get_template_env())
    return task


def _load_demo():
    spec = importlib.util.spec_from_file_location("agr_demo", REPO / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_airflow_lists_no_import_errors_and_every_dag(tmp_path: Path) -> None:
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS)}
    airflow = str(Path(sys.executable).with_name("airflow"))
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, capture_output=True)
    errors = subprocess.run([airflow, "dags", "list-import-errors", "-o", "json"], env=env, check=True,
                            capture_output=True, text=True)
    assert json.loads(errors.stdout.strip().splitlines()[-1]) == []
    report = subprocess.run([airflow, "dags", "report", "-o", "json"], env=env, check=True,
                            capture_output=True, text=True)
    files = json.loads(report.stdout.strip().splitlines()[-1])
    dags = sorted(d for f in files for d in f["dags"])
    assert dags == ["gpu_resilient_training", "gpu_training_sensor", "scheduled_retraining"]


def test_deploy_renders_the_job_gcloud_deploys() -> None:
    """``gcloud beta run jobs deploy gpu-resilient-training --image IMAGE --args ... --gpu 1
    --gpu-type nvidia-l4 --no-gpu-zonal-redundancy --cpu 4 --memory 16Gi --task-timeout 4h
    --max-retries 3 --service-account SA --add-volume name=checkpoint-volume,type=cloud-storage,
    bucket=gpu-resilient-checkpoints --add-volume-mount volume=checkpoint-volume,mount-path=/checkpoints
    --set-env-vars CHECKPOINT_DIR=/checkpoints``, field by field (a GPU task timeout over 1 h is
    a preview feature: gcloud beta sets the BETA launch stage)."""
    task = _rendered("gpu_resilient_training", "deploy_job")
    job = json_format.MessageToDict(run_v2.Job.pb(task.build_spec().to_job()))

    assert job["launchStage"] == "BETA"
    execution = job["template"]
    assert execution.get("taskCount", 1) == 1
    template = execution["template"]
    assert template["maxRetries"] == 3
    assert template["timeout"] == "14400s"
    assert template["serviceAccount"] == SA
    assert template["nodeSelector"] == {"accelerator": "nvidia-l4"}
    assert template["gpuZonalRedundancyDisabled"] is True
    assert template["volumes"] == [{"name": "checkpoint-volume", "gcs": {"bucket": "gpu-resilient-checkpoints"}}]
    [container] = template["containers"]
    assert container["image"] == IMAGE
    assert container["resources"]["limits"] == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}
    assert container["volumeMounts"] == [{"name": "checkpoint-volume", "mountPath": "/checkpoints"}]
    assert {"name": "CHECKPOINT_DIR", "value": "/checkpoints"} in container["env"]
    assert container["args"] == ["train", "--steps=600", "--checkpoint-every=50", "--step-delay=0.0",
                                 "--hidden=128", "--seed=0"]


def test_without_api_endpoint_the_hook_targets_cloud_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook

    connection = {"conn_type": "google_cloud_platform", "extra": {"project": "my-project", "is_anonymous": True}}
    monkeypatch.setenv("AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT", json.dumps(connection))
    client = CloudRunGpuHook().jobs_client("us-central1")
    assert client.api_endpoint.startswith("run.googleapis.com") or "-run.googleapis.com" in client.api_endpoint


def test_scheduled_retraining_gives_each_run_its_own_namespace() -> None:
    from gpu_training_common import namespace_for

    names = {namespace_for(r) for r in ("scheduled__2026-03-01T00:00:00+00:00",
                                         "scheduled__2026-03-02T00:00:00+00:00",
                                         "manual__2026-03-01T00:00:00+00:00")}
    assert len(names) == 3
    run_id = "scheduled__2026-03-01T00:00:00+00:00"
    task = _rendered("scheduled_retraining", "execute_job", ds="2026-03-01", run_id=run_id,
                     namespace_for=namespace_for)
    [container] = task.overrides["container_overrides"]
    assert container["args"][-1] == "--data=data/2026-03-01/digits.npz"
    assert container["env"] == [{"name": "CHECKPOINT_RUN_ID", "value": namespace_for(run_id)}]


def _run_against_emulator(tmp_path: Path, dag_id: str, conf: dict, logical_date: str | None = None):
    demo = _load_demo()
    from airflow_gpu_resilience.emulator.process import EmulatorProcess

    with EmulatorProcess(tmp_path / "emulator", images_file=REPO / "worker" / "emulator-image.json") as emulator:
        log = tmp_path / f"{dag_id}.log"
        rc = demo.run_dag(demo.airflow_env(tmp_path, emulator), conf, log, dag_id=dag_id, logical_date=logical_date)
        assert rc == 0, log.read_text()[-6000:]
        return emulator.bucket_dir("gpu-resilient-checkpoints"), log.read_text()


@pytest.mark.e2e
def test_scheduled_retraining_trains_on_the_days_partition(tmp_path: Path) -> None:
    conf = {"steps": 40, "checkpoint_every": 20, "poll_interval_seconds": 1.0}
    bucket, log = _run_against_emulator(tmp_path, "scheduled_retraining", conf, logical_date="2026-03-01")
    assert (bucket / "data" / "2026-03-01" / "digits.npz").exists()
    [run_dir] = (bucket / "digits-retraining").iterdir()
    assert run_dir.name.startswith("manual-")  # namespace_for(run_id): one folder per DAG run
    metrics = json.loads((run_dir / "task-0" / "metrics.json").read_text())
    assert metrics["steps"] == 40 and metrics["accuracy"] > 0.5


@pytest.mark.e2e
def test_sensor_variant_waits_in_reschedule_mode(tmp_path: Path) -> None:
    conf = {"steps": 40, "checkpoint_every": 20, "poll_interval_seconds": 1.0}
    bucket, log = _run_against_emulator(tmp_path, "gpu_training_sensor", conf)
    assert "up_for_reschedule" in log.lower() or "rescheduling" in log.lower()
    [metrics_file] = (bucket / "gpu-training-sensor").glob("*/task-0/metrics.json")
    metrics = json.loads(metrics_file.read_text())
    assert metrics["steps"] == 40
