"""The build-from-source example DAG (``dags/gpu_training_from_source.py``) against the emulator.

``airflow dags test`` in a new process whose gRPC channels for Cloud Build and Artifact Registry
lead to the emulator (``serve --google-endpoint``), so the google provider's
``CloudBuildCreateBuildOperator`` and the Artifact Registry client run unmodified. The emulator
has no image table: the job can only run what the DAG's build made.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import run_v2

from .test_dags import _load_demo, _storage

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "gpu_training_from_source"
PROJECT, REGION = "local-project", "us-central1"
JOB, BUCKET, REPOSITORY = "gpu-training-from-source", "gpu-training-from-source", "gpu-training"
REPOSITORY_NAME = f"projects/{PROJECT}/locations/{REGION}/repositories/{REPOSITORY}"
TRAINING = {"steps": 40, "checkpoint_every": 10, "step_delay_seconds": 0.1, "poll_interval_seconds": 1.0,
            "cleanup_wait_seconds": 30}


@pytest.fixture
def emulator(tmp_path):
    from cloud_run_emulator.process import EmulatorProcess

    with EmulatorProcess(tmp_path / "emulator", extra_args=["--google-endpoint"]) as emu:
        yield emu


def env_for(tmp_path: Path, emulator) -> dict:
    demo = _load_demo()
    return {**demo.airflow_env(tmp_path, emulator), **emulator.google_endpoint_env}


def run_dag(tmp_path: Path, emulator, conf: dict, name: str) -> tuple[int, str]:
    log_path = tmp_path / f"{name}.log"
    rc = _load_demo().run_dag(env_for(tmp_path, emulator), conf, log_path, dag_id=DAG_ID)
    return rc, log_path.read_text()


def returned(log: str, first_key: str) -> dict:
    """The last ``Returned value was: {...}`` of a task whose result starts with ``first_key``."""
    found = re.findall(rf"Returned value was: (\{{'{first_key}'.*\}})", log)
    assert found, log[-6000:]
    from ast import literal_eval

    return literal_eval(found[-1])


def registry(emulator):
    """The Artifact Registry client on the emulator's gRPC port."""
    import grpc
    from google.cloud import artifactregistry_v1 as ar
    from google.cloud.artifactregistry_v1.services.artifact_registry.transports import ArtifactRegistryGrpcTransport

    return ar.ArtifactRegistryClient(transport=ArtifactRegistryGrpcTransport(
        channel=grpc.insecure_channel(emulator.grpc_endpoint)))


def run_python(tmp_path: Path, emulator, code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a new process with the DAG's Airflow environment and ``dags/`` importable,
    its gRPC channels to Cloud Build and Artifact Registry leading to the emulator."""
    env = {**env_for(tmp_path, emulator), "PYTHONPATH": f"{REPO}:{REPO / 'dags'}"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def run_task(tmp_path: Path, emulator, task_id: str, **params) -> subprocess.CompletedProcess:
    """Call one ``@task`` of the DAG with its default params updated by ``params``."""
    return run_python(tmp_path, emulator, (
        "from tests.airflow_compat import DagBag\n"
        f"dag = DagBag(dag_folder='dags/{DAG_ID}.py').dags['{DAG_ID}']\n"
        f"dag.get_task({task_id!r}).python_callable(params={{**dag.params.dump(), **{params!r}}})\n"))


class Preempter(threading.Thread):
    """Maintenance-preempts task 0 once its progress passes ``at_step``, as ``make demo`` does."""

    def __init__(self, emulator, at_step: int) -> None:
        super().__init__(daemon=True)
        self.emulator, self.at_step, self.done, self.stop = emulator, at_step, [], threading.Event()
        self.jobs = run_v2.JobsClient(credentials=AnonymousCredentials(), transport="rest",
                                      client_options={"api_endpoint": emulator.endpoint})

    def _step(self) -> int:
        for progress in (self.emulator.bucket_dir(BUCKET) / JOB).glob("*/task-0/progress.json"):
            try:
                return int(json.loads(progress.read_text())["step"])
            except (OSError, ValueError, KeyError):
                return -1
        return -1

    def run(self) -> None:
        while not self.stop.is_set() and self._step() < self.at_step:
            time.sleep(0.05)
        if not self.stop.is_set():
            execution = self.jobs.get_job(name=f"projects/{PROJECT}/locations/{REGION}/jobs/{JOB}")
            self.done.append(self.emulator.preempt(execution.latest_created_execution.name, 0, grace_seconds=5))


@pytest.mark.e2e
def test_the_dag_builds_from_source_deploys_by_digest_trains_through_a_preemption_and_tears_down(tmp_path, emulator):
    preempter = Preempter(emulator, at_step=15)
    preempter.start()
    rc, log = run_dag(tmp_path, emulator, TRAINING, "first")
    preempter.stop.set()
    assert rc == 0, log[-6000:]
    assert preempter.done, "the training ended before the preemption"

    [reference] = set(re.findall(r"Built (\S+@sha256:[0-9a-f]{64})", log))
    assert reference.startswith(f"{REGION}-docker.pkg.dev/{PROJECT}/{REPOSITORY}/airflow-gpu-resilience-worker@")
    assert f"Created Artifact Registry repository {REPOSITORY_NAME}" in log
    report = returned(log, "tasks")
    [task] = report["tasks"]
    assert task["steps"] == 40 and task["attempts"] >= 2, report  # trained on through the preemption
    done = returned(log, "job")
    assert done["job"] == "deleted" and done["bucket"]["deleted"] is True, done
    tag = f"{reference.split('@')[0]}:{done['images'][0].rsplit(':', 1)[-1]}"
    assert (done["images"], done["repository"]) == ([tag, reference], "deleted"), done
    with pytest.raises(gexc.NotFound):
        registry(emulator).get_repository(name=REPOSITORY_NAME)
    assert _storage(emulator).lookup_bucket(BUCKET) is None
    [build_log] = (emulator.data_dir / "builds").glob("*/log.txt")
    assert "Successfully tagged" in build_log.read_text()

    # a second run makes everything again: its own repository, build, image and job
    rc, again = run_dag(tmp_path, emulator, {**TRAINING, "steps": 10}, "second")
    assert rc == 0, again[-6000:]
    assert f"Created Artifact Registry repository {REPOSITORY_NAME}" in again
    assert len(list((emulator.data_dir / "builds").glob("*/log.txt"))) == 2
    second = returned(again, "job")
    assert (second["job"], second["bucket"]["deleted"], second["repository"]) == ("deleted", True, "deleted"), second
    assert len(second["images"]) == 2  # its tag and its version


@pytest.mark.e2e
def test_a_failing_build_fails_the_build_task_and_nothing_is_deployed(tmp_path, emulator):
    source = tmp_path / "broken-source"
    source.mkdir()
    (source / "Dockerfile").write_text("FORM python:3.12\nENTRYPOINT [\"python\", \"main.py\"]\n")
    (source / "main.py").write_text("print('never built')\n")
    rc, log = run_dag(tmp_path, emulator, {**TRAINING, "source_dir": str(source)}, "failing")

    assert rc != 0, log[-6000:]
    assert "Build failed; check build logs for details" in log
    assert "CreateJob" not in emulator.requests()["methods"]  # nothing deployed
    [build_log] = (emulator.data_dir / "builds").glob("*/log.txt")
    assert "dockerfile parse error on line 1: unknown instruction: FORM" in build_log.read_text()
    done = returned(log, "job")  # the teardown still deletes what the run made
    assert (done["job"], done["bucket"]["deleted"], done["images"], done["repository"]) == (
        "absent", True, [], "deleted"), done


def test_a_foreign_repository_fails_the_dag_before_anything_is_touched(tmp_path, emulator):
    """Someone else's repository of the same name (no ``managed-by`` label) fails
    ``ensure_repository``, naming it and what to do, and is left as it was; that task comes
    right after the read-only job check, before every task that creates or uploads anything."""
    from google.cloud import artifactregistry_v1 as ar

    from tests.airflow_compat import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags" / f"{DAG_ID}.py")).dags[DAG_ID]
    assert dag.get_task("ensure_repository").upstream_task_ids == {"check_job_is_ours"}
    assert dag.get_task("create_bucket").upstream_task_ids == {"ensure_repository"}

    client = registry(emulator)
    theirs = ar.Repository(format_=ar.Repository.Format.DOCKER, labels={"team": "vision"})
    client.create_repository(parent=REPOSITORY_NAME.rsplit("/repositories/", 1)[0], repository_id=REPOSITORY,
                             repository=theirs).result(timeout=30)
    result = run_task(tmp_path, emulator, "ensure_repository")
    assert result.returncode != 0
    assert f"repository '{REPOSITORY_NAME}' already exists and is not this deployment's" in result.stderr, result.stderr
    assert "--update-labels=managed-by=airflow-gpu-resilience" in result.stderr
    assert client.get_repository(name=REPOSITORY_NAME).labels == {"team": "vision"}
    assert _storage(emulator).lookup_bucket(BUCKET) is None


def test_the_source_archive_skips_what_dockerignore_names_and_needs_a_dockerfile(tmp_path):
    sys.path.insert(0, str(REPO / "dags"))
    from gpu_training_build import SourceFolderError, source_archive

    import io
    import tarfile

    (tmp_path / "Dockerfile").write_text("FROM x\n")
    (tmp_path / ".dockerignore").write_text("# comment\n__pycache__/\n*.pyc\nbuild/\n")
    for name in ("pkg/a.py", "pkg/__pycache__/a.cpython.pyc", "build/lib/x.py", "top.pyc"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    data = source_archive(tmp_path)
    assert data == source_archive(tmp_path)  # the same source, the same bytes
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert sorted(tar.getnames()) == [".dockerignore", "Dockerfile", "pkg/a.py"]
    (tmp_path / "Dockerfile").unlink()
    with pytest.raises(SourceFolderError, match="has no Dockerfile"):
        source_archive(tmp_path)
    with pytest.raises(SourceFolderError, match="does not exist"):
        source_archive(tmp_path / "missing")


def test_a_source_dir_that_cannot_be_built_fails_before_anything_is_made(tmp_path, emulator):
    """A missing folder, a file, a folder without a Dockerfile: ``ensure_repository``, the first
    task that makes anything, fails naming ``source_dir``; no repository, no bucket."""
    (tmp_path / "no-dockerfile").mkdir()
    (tmp_path / "a-file").write_text("x")
    cases = {"missing": "does not exist", "a-file": "is not a folder", "no-dockerfile": "has no Dockerfile"}
    for folder, reason in cases.items():
        result = run_task(tmp_path, emulator, "ensure_repository", source_dir=str(tmp_path / folder))
        assert result.returncode != 0
        assert f"source_dir '{tmp_path / folder}' {reason}" in result.stderr, result.stderr
    with pytest.raises(gexc.NotFound):
        registry(emulator).get_repository(name=REPOSITORY_NAME)
    assert _storage(emulator).lookup_bucket(BUCKET) is None


def _build(emulator, tmp_path: Path, tag: str) -> str:
    """Build ``tmp_path/source`` with Cloud Build on the emulator, pushed as ``tag``; its digest."""
    import grpc
    from google.cloud.devtools import cloudbuild_v1 as cb
    from google.cloud.devtools.cloudbuild_v1.services.cloud_build.transports import CloudBuildGrpcTransport

    sys.path.insert(0, str(REPO / "dags"))
    from gpu_training_build import source_archive

    bucket = _storage(emulator).bucket("build-sources")
    if not bucket.exists():
        bucket.create()
    bucket.blob("source.tar.gz").upload_from_string(source_archive(tmp_path / "source"))
    builds = cb.CloudBuildClient(transport=CloudBuildGrpcTransport(channel=grpc.insecure_channel(
        emulator.grpc_endpoint)))
    build = cb.Build(source={"storage_source": {"bucket": bucket.name, "object_": "source.tar.gz"}},
                     steps=[{"name": "gcr.io/cloud-builders/docker", "args": ["build", "-t", tag, "."]}], images=[tag])
    build = builds.create_build(parent=f"projects/{PROJECT}/locations/{REGION}", project_id=PROJECT,
                                build=build).result(timeout=120)
    [pushed] = build.results.images
    return pushed.digest


def test_the_teardown_deletes_only_its_own_tag_when_another_run_pushed_the_same_digest(tmp_path, emulator):
    """Two builds of the same source push the same digest under two runs' tags: deleting one
    run's image deletes its tag only, and the repository stays; the other run's teardown then
    deletes the version, the package and the (ours, now empty) repository."""
    from google.cloud import artifactregistry_v1 as ar

    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "Dockerfile").write_text('FROM python:3.12\nENTRYPOINT ["python", "-c", "print(1)"]\n')
    client = registry(emulator)
    ours = ar.Repository(format_=ar.Repository.Format.DOCKER, labels={"managed-by": "airflow-gpu-resilience"})
    client.create_repository(parent=REPOSITORY_NAME.rsplit("/repositories/", 1)[0], repository_id=REPOSITORY,
                             repository=ours).result(timeout=30)
    image = f"{REGION}-docker.pkg.dev/{PROJECT}/{REPOSITORY}/airflow-gpu-resilience-worker"
    digest = _build(emulator, tmp_path, f"{image}:other-run")
    assert _build(emulator, tmp_path, f"{image}:this-run") == digest
    teardown = ("from gpu_training_build import ArtifactRepositoryHook\n"
                "hook = ArtifactRepositoryHook(gcp_conn_id='google_cloud_default')\n"
                f"print('RESULT', hook.delete_run_image({{tag!r}}, {digest!r}))\n"
                f"print('RESULT', hook.delete_repository_if_ours_and_empty({PROJECT!r}, {REGION!r}, {REPOSITORY!r}))\n")

    def results(output: str) -> list:
        return [line.removeprefix("RESULT ") for line in output.splitlines() if line.startswith("RESULT ")]

    result = run_python(tmp_path, emulator, teardown.format(tag=f"{image}:this-run"))
    assert result.returncode == 0, result.stderr
    assert results(result.stdout) == [f"['{image}:this-run']", "kept: 1 package(s) left"], result
    [left] = client.list_docker_images(parent=REPOSITORY_NAME)
    assert (left.uri, list(left.tags)) == (f"{image}@{digest}", ["other-run"])

    result = run_python(tmp_path, emulator, teardown.format(tag=f"{image}:other-run"))
    assert result.returncode == 0, result.stderr
    assert results(result.stdout) == [f"['{image}:other-run', '{image}@{digest}']", "deleted"], result
    with pytest.raises(gexc.NotFound):
        client.get_repository(name=REPOSITORY_NAME)
