"""The example DAGs: they import cleanly, render the Job gcloud would deploy, and run.

The rendering tests load the DAG files unchanged from ``dags/`` and render their templates with
the default params, as Airflow does at run time; the run tests drive ``airflow dags test``
against the Cloud Run and GCS emulators with the bundled worker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
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


def _airflow_cli_parse(home: Path, dags_folder: Path) -> tuple[list[dict], list[dict]]:
    """Parse ``dags_folder`` with the Airflow CLI as a deployment would, on a fresh database.

    ``airflow dags list-import-errors`` reads what a parse stored in the database, so the DAG
    files are parsed and stored first (``airflow dags reserialize``, as the DAG processor would).

    :return: the import errors and ``airflow dags report``'s rows, both as JSON.
    """
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder)}
    airflow = str(Path(sys.executable).with_name("airflow"))

    def cli(*args: str, check: bool = True) -> str:
        return subprocess.run([airflow, *args], env=env, check=check, capture_output=True, text=True).stdout

    cli("db", "migrate")
    cli("dags", "reserialize")
    # It exits 1 when it lists errors; the listing is what is checked.
    errors = json.loads(cli("dags", "list-import-errors", "-o", "json", check=False).strip().splitlines()[-1])
    report = json.loads(cli("dags", "report", "-o", "json").strip().splitlines()[-1])
    return errors, report


def test_airflow_lists_no_import_errors_and_every_dag(tmp_path: Path) -> None:
    errors, report = _airflow_cli_parse(tmp_path, DAGS)
    assert errors == []
    dags = sorted(d for f in report for d in f["dags"])
    assert dags == [
        "gpu_resilient_training", "gpu_training_from_source", "gpu_training_sensor", "scheduled_retraining"]


def test_airflow_cli_parse_reports_a_broken_dag_file(tmp_path: Path) -> None:
    """The check above can fail: a DAG file that does not import is listed with its error."""
    folder = tmp_path / "dags"
    folder.mkdir()
    for source in DAGS.glob("*.py"):
        (folder / source.name).write_text(source.read_text())
    (folder / "broken_dag.py").write_text("from airflow import DAG\nimport a_module_that_does_not_exist\n")
    errors, _ = _airflow_cli_parse(tmp_path / "home", folder)
    assert [Path(e["filepath"]).name for e in errors] == ["broken_dag.py"]
    assert "a_module_that_does_not_exist" in errors[0]["error"]


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
                                 "--hidden=128", "--seed=0", "--preemption-save=deadline"]


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
    from cloud_run_emulator.process import EmulatorProcess

    with EmulatorProcess(tmp_path / "emulator", images_file=REPO / "worker" / "emulator-image.json") as emulator:
        log = tmp_path / f"{dag_id}.log"
        rc = demo.run_dag(demo.airflow_env(tmp_path, emulator), conf, log, dag_id=dag_id, logical_date=logical_date)
        assert rc == 0, log.read_text()[-6000:]
        return emulator.bucket_dir("gpu-resilient-checkpoints"), log.read_text()


BUCKET = "gpu-resilient-checkpoints"
JOB = "gpu-resilient-training"
OURS = {"managed-by": "airflow-gpu-resilience", "gcp-project": "local-project"}


def _storage(emulator):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project="local-project", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": emulator.gcs_endpoint})


def _jobs(emulator):
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials

    return run_v2.JobsClient(credentials=AnonymousCredentials(), transport="rest",
                             client_options=ClientOptions(api_endpoint=emulator.endpoint))


def _task_log(log: str, task_id: str) -> str:
    """The lines ``airflow dags test`` printed that name ``task_id`` or a traceback."""
    return "\n".join(line for line in log.splitlines() if task_id in line or line.startswith("  File"))


@pytest.mark.e2e
def test_cleanup_deletes_our_bucket_with_300_checkpoints_and_reports_it(tmp_path: Path) -> None:
    """Item 6: the bucket from an earlier run holds 300 more objects than the 256 the client's
    forced delete accepts; cleanup deletes them in batches, then the bucket, and reports the
    count and bytes in its log and its return value (XCom)."""
    from cloud_run_emulator.process import EmulatorProcess

    demo = _load_demo()
    conf = {"steps": 20, "checkpoint_every": 10, "poll_interval_seconds": 1.0, "delete_bucket": True}
    with EmulatorProcess(tmp_path / "emulator", images_file=REPO / "worker" / "emulator-image.json") as emulator:
        bucket = _storage(emulator).create_bucket(BUCKET)
        bucket.labels = OURS  # ours, from an earlier run
        bucket.patch()
        for i in range(300):
            bucket.blob(f"{JOB}/earlier-run/task-0/ckpt-{i:08d}.pt").upload_from_string(b"c" * 100)
        log_path = tmp_path / "run.log"
        rc = demo.run_dag(demo.airflow_env(tmp_path, emulator), conf, log_path)
        log = log_path.read_text()
        assert rc == 0, log[-6000:]
        assert _storage(emulator).lookup_bucket(BUCKET) is None, _task_log(log, "cleanup")[-4000:]
        assert not emulator.bucket_dir(BUCKET).exists()
    # one cleanup, whose line Airflow 2.11's dags test logs twice (task log and console)
    [(objects, size)] = set(re.findall(rf"Deleted bucket {BUCKET}: (\d+) objects, (\d+) bytes", log))
    # the 300 earlier checkpoints, plus this run's dataset, checkpoints, progress and metrics
    assert int(objects) > 300 and int(size) > 300 * 100
    returned = re.search(r"Returned value was: (\{'job'.*\})", log)  # cleanup's return value (XCom)
    assert returned, _task_log(log, "cleanup")[-4000:]
    assert f"'objects_deleted': {objects}" in returned.group(1) and f"'bytes_deleted': {size}" in returned.group(1)
    assert "'job': 'deleted'" in returned.group(1)


@pytest.mark.e2e
def test_a_bucket_that_is_not_ours_fails_setup_before_the_grant_and_upload(tmp_path: Path) -> None:
    """Item 7: someone else's bucket of the same name (no ``managed-by`` label) fails
    ``create_bucket`` with an error naming the bucket and what to do; its IAM policy, its objects
    and the bucket itself stay as they were, even with ``delete_bucket`` set (the cleanup teardown
    does not run, its setup failed), and no job is deployed."""
    from cloud_run_emulator.process import EmulatorProcess

    demo = _load_demo()
    conf = {"steps": 20, "checkpoint_every": 10, "poll_interval_seconds": 1.0, "delete_bucket": True}
    with EmulatorProcess(tmp_path / "emulator", images_file=REPO / "worker" / "emulator-image.json") as emulator:
        theirs = _storage(emulator).create_bucket(BUCKET)
        theirs.blob("their-data.csv").upload_from_string(b"a,b\n1,2\n")
        bindings_before = list(theirs.get_iam_policy(requested_policy_version=3).bindings)
        log_path = tmp_path / "run.log"
        rc = demo.run_dag(demo.airflow_env(tmp_path, emulator), conf, log_path)
        log = log_path.read_text()

        assert rc != 0, log[-6000:]
        assert f"Bucket '{BUCKET}' already exists and is not this deployment's" in log
        assert "Choose another `bucket` param" in log and "--update-labels=managed-by=airflow-gpu-resilience" in log
        client = _storage(emulator)
        after = client.get_bucket(BUCKET)
        assert list(after.get_iam_policy(requested_policy_version=3).bindings) == bindings_before == []
        assert [b.name for b in client.list_blobs(BUCKET)] == ["their-data.csv"]  # no dataset uploaded
        assert after.labels == {}
        assert list(_jobs(emulator).list_jobs(parent="projects/local-project/locations/us-central1")) == []


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


def test_every_dag_checks_the_job_is_ours_before_creating_the_bucket() -> None:
    bag = _dagbag()
    for dag_id in ("gpu_resilient_training", "gpu_training_sensor", "scheduled_retraining"):
        dag = bag.dags[dag_id]
        assert dag.get_task("check_job_is_ours").downstream_task_ids == {"create_bucket"}, dag_id
        assert dag.get_task("create_bucket").downstream_task_ids >= {"grant_bucket_access"}, dag_id
        assert not dag.get_task("check_job_is_ours").upstream_task_ids, dag_id


def test_cleanup_deletes_only_the_job_and_bucket_that_are_ours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The task code, called as Airflow calls it, against the emulators: a job of the DAG's name
    without our label (someone else's) fails ``check_job_is_ours``, naming it and what to do, and
    cleanup keeps it; ``delete_bucket`` on a bucket without our label raises, naming it, and
    deletes nothing; our job passes the check and cleanup deletes it."""
    from airflow.providers.common.compat.sdk import AirflowFailException

    from cloud_run_emulator.process import EmulatorProcess
    from airflow_gpu_resilience.job_spec import GpuJobSpec

    demo = _load_demo()
    cleanup = _dagbag().dags["gpu_resilient_training"].get_task("cleanup").python_callable
    parent = "projects/local-project/locations/us-central1"
    with EmulatorProcess(tmp_path / "emulator", images_file=REPO / "worker" / "emulator-image.json") as emulator:
        for key, value in demo.airflow_env(tmp_path, emulator).items():
            if key.startswith(("AIRFLOW_CONN_", "STORAGE_EMULATOR_HOST", "GCE_", "NO_GCE")):
                monkeypatch.setenv(key, value)
        theirs = _storage(emulator).create_bucket(BUCKET)
        theirs.blob("their-data.csv").upload_from_string(b"1")
        jobs = _jobs(emulator)
        jobs.create_job(parent=parent, job_id=JOB, job=GpuJobSpec(name=JOB, image=IMAGE).to_job()).result(timeout=60)
        params = {**_dagbag().dags["gpu_resilient_training"].params.dump(), "delete_bucket": True}

        check = _dagbag().dags["gpu_resilient_training"].get_task("check_job_is_ours").python_callable
        with pytest.raises(AirflowFailException, match=f"Cloud Run job '{JOB}' already exists .* is not this"):
            check(params=params)
        with pytest.raises(AirflowFailException, match=f"Bucket '{BUCKET}' already exists and is not"):
            cleanup(params=params)
        assert jobs.get_job(name=f"{parent}/jobs/{JOB}").name.endswith(JOB)  # not ours: kept
        assert [b.name for b in _storage(emulator).list_blobs(BUCKET)] == ["their-data.csv"]

        job = GpuJobSpec(name="ours", image=IMAGE, labels={"managed-by": "airflow-gpu-resilience"}).to_job()
        jobs.create_job(parent=parent, job_id="ours", job=job).result(timeout=60)
        assert check(params={**params, "job_name": "ours"}) == "ours"
        assert check(params={**params, "job_name": "absent"}) == "absent"
        done = cleanup(params={**params, "job_name": "ours", "delete_bucket": False})
        assert (done["job"], done["job_cleanup"]["action"], done["bucket"]) == ("deleted", "deleted", None)
        assert [j.name.rsplit("/", 1)[-1] for j in jobs.list_jobs(parent=parent)] == [JOB]


def test_cleanup_keeps_the_bucket_while_an_execution_of_the_job_still_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``delete_bucket`` with an execution still running after ``cleanup_wait_seconds`` (the job
    is kept for it) must not delete the bucket that execution is writing its checkpoints to; the
    same with ``keep_job``; once the execution has ended, the bucket goes."""
    from cloud_run_emulator.process import EmulatorProcess
    from airflow_gpu_resilience.job_spec import GpuJobSpec

    demo = _load_demo()
    images = tmp_path / "images.json"
    images.write_text(json.dumps({"images": {"test.local/sleeper:latest": {
        "entrypoint": ["{python}", "-c", "import time; time.sleep(120)"]}}}))
    cleanup = _dagbag().dags["gpu_resilient_training"].get_task("cleanup").python_callable
    parent = "projects/local-project/locations/us-central1"
    with EmulatorProcess(tmp_path / "emulator", images_file=images) as emulator:
        for key, value in demo.airflow_env(tmp_path, emulator).items():
            if key.startswith(("AIRFLOW_CONN_", "STORAGE_EMULATOR_HOST", "GCE_", "NO_GCE")):
                monkeypatch.setenv(key, value)
        bucket = _storage(emulator).create_bucket(BUCKET)
        bucket.labels = OURS
        bucket.patch()
        bucket.blob(f"{JOB}/task-0/ckpt-00000050.pt").upload_from_string(b"state")
        jobs = _jobs(emulator)
        job = GpuJobSpec(name=JOB, image="test.local/sleeper:latest", checkpoint_bucket=BUCKET, max_retries=0,
                         labels={"managed-by": "airflow-gpu-resilience"}).to_job()
        jobs.create_job(parent=parent, job_id=JOB, job=job).result(timeout=60)
        execution = jobs.run_job(name=f"{parent}/jobs/{JOB}").metadata.name
        from google.auth.credentials import AnonymousCredentials

        executions = run_v2.ExecutionsClient(credentials=AnonymousCredentials(), transport="rest",
                                             client_options={"api_endpoint": emulator.endpoint})
        params = {**_dagbag().dags["gpu_resilient_training"].params.dump(), "delete_bucket": True,
                  "cleanup_wait_seconds": 0, "poll_interval_seconds": 0.2}

        for extra in ({}, {"keep_job": True}):
            done = cleanup(params={**params, **extra})
            assert done["job"] in ("kept: an execution is still running", "kept (keep_job)"), done
            assert done["bucket"]["deleted"] is False, done
            assert execution in done["bucket"]["reason"], done
            assert [b.name for b in _storage(emulator).list_blobs(BUCKET)] == [f"{JOB}/task-0/ckpt-00000050.pt"]

        executions.cancel_execution(name=execution).result(timeout=60)
        done = cleanup(params={**params, "cleanup_wait_seconds": 60})
        assert done["job"] == "deleted" and done["bucket"]["deleted"] is True, done
        assert _storage(emulator).lookup_bucket(BUCKET) is None
