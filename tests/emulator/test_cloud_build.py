"""Cloud Build and Artifact Registry on the emulator's gRPC port, with the unmodified
``google-cloud-build`` and ``google-cloud-artifact-registry`` clients: a build from a source
archive in the emulated Cloud Storage becomes an image a Cloud Run job runs by digest; builds
that fail say why as Cloud Build does; the repository and image resources a teardown lists and
deletes."""

from __future__ import annotations

import hashlib
import io
import tarfile
import time
import uuid

import pytest
from google.api_core import exceptions as gexc
from google.cloud import artifactregistry_v1 as ar
from google.cloud import run_v2
from google.cloud.artifactregistry_v1.services.artifact_registry.transports import ArtifactRegistryGrpcTransport
from google.cloud.devtools import cloudbuild_v1 as cb
from google.cloud.devtools.cloudbuild_v1.services.cloud_build.transports import CloudBuildGrpcTransport

from .conftest import make_job

PROJECT, REGION = "test-project", "us-central1"
PARENT = f"projects/{PROJECT}/locations/{REGION}"
#: The program the test image runs: it prints a file of its own source and its first argument.
PROGRAM = "import pathlib, sys; print(pathlib.Path('message.txt').read_text().strip(), sys.argv[1:])"
DOCKERFILE = f"""# a test image
FROM python:3.12-slim AS base
WORKDIR /app
COPY . /app/
ENV GREETING=hello \\
    MODE="built image"
ENTRYPOINT ["python", "/app/main.py"]
CMD ["from-cmd"]
"""


@pytest.fixture(scope="module")
def builds(grpc_channel):
    return cb.CloudBuildClient(transport=CloudBuildGrpcTransport(channel=grpc_channel))


@pytest.fixture(scope="module")
def registry(grpc_channel):
    return ar.ArtifactRegistryClient(transport=ArtifactRegistryGrpcTransport(channel=grpc_channel))


@pytest.fixture
def repository(registry):
    """A new Docker repository labelled ``managed-by``; deleted afterwards if still there."""
    repo_id = f"repo-{uuid.uuid4().hex[:8]}"
    repo = ar.Repository(format_=ar.Repository.Format.DOCKER, labels={"managed-by": "airflow-gpu-resilience"})
    created = registry.create_repository(parent=PARENT, repository_id=repo_id, repository=repo).result(timeout=30)
    yield created
    try:
        registry.delete_repository(name=created.name).result(timeout=30)
    except gexc.NotFound:
        pass


def archive(files: dict) -> bytes:
    """A ``.tar.gz`` of ``{relative path: text}``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def source_files(message: str = "built from source") -> dict:
    return {"Dockerfile": DOCKERFILE, "main.py": PROGRAM, "message.txt": message}


def docker_build(bucket, files: dict, image: str, steps=None, images=None) -> cb.Build:
    """A Build of ``files`` (uploaded to ``bucket`` as a source archive), logs in ``bucket``."""
    name = f"source/{uuid.uuid4().hex}.tar.gz"
    bucket.blob(name).upload_from_string(archive(files))
    if steps is None:
        steps = [{"name": "gcr.io/cloud-builders/docker", "args": ["build", "-t", image, "."]}]
    return cb.Build(source={"storage_source": {"bucket": bucket.name, "object_": name}}, steps=steps,
                    images=[image] if images is None else images, logs_bucket=f"gs://{bucket.name}/build-logs")


def image_uri(repository: ar.Repository, image: str = "trainer", tag: str = "v1") -> str:
    return f"{repository.registry_uri}/{image}:{tag}"


def context_digest(files: dict) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name].encode()).digest())
    return f"sha256:{digest.hexdigest()}"


def run_execution(jobs, executions, image: str, job_id: str) -> run_v2.Execution:
    job = make_job(image, max_retries=0)
    jobs.create_job(parent=PARENT, job_id=job_id, job=job).result(timeout=30)
    return jobs.run_job(name=f"{PARENT}/jobs/{job_id}").result(timeout=120)


def attempt_log(emulator, execution: str) -> str:
    return "".join(p.read_text() for p in (emulator.data_dir / "logs" / execution.rsplit("/", 1)[-1]).glob("*.log"))


def test_a_build_from_a_source_archive_runs_as_a_job_by_digest_until_its_image_is_deleted(
        emulator, builds, registry, repository, bucket, jobs, executions, job_id):
    files = source_files()
    uri = image_uri(repository)
    operation = builds.create_build(parent=PARENT, project_id=PROJECT, build=docker_build(bucket, files, uri))
    assert operation.metadata.build.status in (cb.Build.Status.QUEUED, cb.Build.Status.WORKING, cb.Build.Status.SUCCESS)
    build = operation.result(timeout=60)

    assert build.status == cb.Build.Status.SUCCESS and build.steps[0].status == cb.Build.Status.SUCCESS
    [pushed] = build.results.images
    assert (pushed.name, pushed.digest) == (uri, context_digest(files))
    assert builds.get_build(project_id=PROJECT, id=build.id).status == cb.Build.Status.SUCCESS
    log = bucket.blob(f"build-logs/log-{build.id}.txt").download_as_text()
    assert "FETCHSOURCE" in log and f"Successfully tagged {uri}" in log and log.rstrip().endswith("DONE")
    [listed] = registry.list_docker_images(parent=repository.name)
    assert (listed.uri, list(listed.tags)) == (f"{repository.registry_uri}/trainer@{pushed.digest}", ["v1"])

    by_digest = f"{repository.registry_uri}/trainer@{pushed.digest}"
    execution = run_execution(jobs, executions, by_digest, job_id)
    assert execution.succeeded_count == 1
    assert "built from source ['from-cmd']" in attempt_log(emulator, execution.name)

    version = f"{repository.name}/packages/trainer/versions/{pushed.digest}"
    with pytest.raises(gexc.FailedPrecondition, match="has tags"):
        registry.delete_version(name=version).result(timeout=30)
    registry.delete_version(request={"name": version, "force": True}).result(timeout=30)
    assert list(registry.list_docker_images(parent=repository.name)) == []
    failed = jobs.run_job(name=f"{PARENT}/jobs/{job_id}")
    with pytest.raises(gexc.GoogleAPICallError, match="not in the emulator's image table"):
        failed.result(timeout=120)  # the deleted image no longer runs


def test_the_same_source_gives_the_same_digest_and_moves_the_tag(builds, registry, repository, bucket):
    uri = image_uri(repository, tag="latest")
    first = builds.create_build(parent=PARENT, build=docker_build(bucket, source_files("one"), uri)).result(timeout=60)
    again = builds.create_build(parent=PARENT, build=docker_build(bucket, source_files("one"), uri)).result(timeout=60)
    other = builds.create_build(parent=PARENT, build=docker_build(bucket, source_files("two"), uri)).result(timeout=60)
    assert first.id != again.id and first.results.images[0].digest == again.results.images[0].digest
    assert other.results.images[0].digest != first.results.images[0].digest
    package = f"{repository.name}/packages/trainer"
    versions = {v.name.rsplit("/", 1)[-1]: [t.name.rsplit("/", 1)[-1] for t in v.related_tags]
                for v in registry.list_versions(parent=package)}
    assert versions == {first.results.images[0].digest: [], other.results.images[0].digest: ["latest"]}
    assert [p.name for p in registry.list_packages(parent=repository.name)] == [package]
    registry.delete_package(name=package).result(timeout=30)
    assert list(registry.list_packages(parent=repository.name)) == []


FAILING = [
    ("no Dockerfile", {"main.py": PROGRAM}, None, None, cb.Build.FailureInfo.FailureType.USER_BUILD_STEP,
     "lstat /workspace/Dockerfile: no such file or directory"),
    ("unknown instruction", {"Dockerfile": "FORM python:3.12\nCMD [\"x\"]\n"}, None, None,
     cb.Build.FailureInfo.FailureType.USER_BUILD_STEP, "dockerfile parse error on line 1: unknown instruction: FORM"),
    ("instruction before FROM", {"Dockerfile": "CMD [\"x\"]\n"}, None, None,
     cb.Build.FailureInfo.FailureType.USER_BUILD_STEP, "no build stage in current context"),
    ("other builder", source_files(), [{"name": "ubuntu", "args": ["false"]}], [],
     cb.Build.FailureInfo.FailureType.USER_BUILD_STEP, "builder 'ubuntu' is not emulated"),
    ("image never built", source_files(), [{"name": "gcr.io/cloud-builders/docker", "args": ["build", "."]}], None,
     cb.Build.FailureInfo.FailureType.PUSH_IMAGE_NOT_FOUND, "failed to find one or more images"),
]


@pytest.mark.parametrize("files, steps, images, failure, detail", [case[1:] for case in FAILING],
                         ids=[case[0] for case in FAILING])
def test_a_failing_build_fails_its_operation_with_cloud_builds_status_and_log(
        builds, registry, repository, bucket, files, steps, images, failure, detail):
    uri = image_uri(repository)
    operation = builds.create_build(parent=PARENT, build=docker_build(bucket, files, uri, steps, images))
    with pytest.raises(gexc.Unknown, match="Build failed; check build logs for details"):
        operation.result(timeout=60)
    build = builds.get_build(name=operation.metadata.build.name)
    assert build.status == cb.Build.Status.FAILURE and build.failure_info.type_ == failure
    log = bucket.blob(f"build-logs/log-{build.id}.txt").download_as_text()
    assert detail in log and log.rstrip().endswith("FAILURE")
    if failure == cb.Build.FailureInfo.FailureType.USER_BUILD_STEP:  # the step's why is in its log only
        last = len(build.steps) - 1
        detail = f'build step {last} "{build.steps[-1].name}" failed: step exited with non-zero status: 1'
        assert build.steps[-1].status == cb.Build.Status.FAILURE and build.steps[-1].exit_code == 1
    assert detail in build.status_detail and build.failure_info.detail == build.status_detail
    assert list(registry.list_docker_images(parent=repository.name)) == []  # nothing pushed


def test_a_push_to_a_missing_repository_fails_the_build(builds, bucket):
    uri = f"{REGION}-docker.pkg.dev/{PROJECT}/no-such-repo/trainer:v1"
    operation = builds.create_build(parent=PARENT, build=docker_build(bucket, source_files(), uri))
    with pytest.raises(gexc.Unknown):
        operation.result(timeout=60)
    build = builds.get_build(project_id=PROJECT, id=operation.metadata.build.id)
    assert build.failure_info.type_ == cb.Build.FailureInfo.FailureType.PUSH_FAILED
    assert 'Repository "no-such-repo" not found' in build.status_detail


@pytest.mark.parametrize("build, message", [
    (cb.Build(steps=[{"name": "gcr.io/cloud-builders/docker", "args": ["build", "."]}]), "storage_source"),
    (cb.Build(source={"storage_source": {"bucket": "b-x", "object_": "s.tgz"}}), "at least one step"),
    (cb.Build(source={"storage_source": {"bucket": "b-x", "object_": "s.tgz"}}, logs_bucket="gs://no-such-bucket-x",
              steps=[{"name": "gcr.io/cloud-builders/docker", "args": ["build", "."]}]), "no-such-bucket-x"),
])
def test_a_build_request_it_cannot_run_is_refused_at_once(builds, build, message):
    with pytest.raises(gexc.InvalidArgument, match=message):
        builds.create_build(parent=PARENT, build=build)


def test_repositories_with_labels_and_their_errors(registry, repository):
    got = registry.get_repository(name=repository.name)
    assert got.labels == {"managed-by": "airflow-gpu-resilience"} and got.format_ == ar.Repository.Format.DOCKER
    assert repository.name in [r.name for r in registry.list_repositories(parent=PARENT)]
    repo_id = repository.name.rsplit("/", 1)[-1]
    with pytest.raises(gexc.AlreadyExists):
        registry.create_repository(parent=PARENT, repository_id=repo_id, repository={"format_": "DOCKER"})
    with pytest.raises(gexc.InvalidArgument, match="DOCKER"):
        registry.create_repository(parent=PARENT, repository_id="maven-one", repository={"format_": "MAVEN"})
    with pytest.raises(gexc.InvalidArgument, match="repository_id"):
        registry.create_repository(parent=PARENT, repository_id="Bad_Id", repository={"format_": "DOCKER"})
    registry.delete_repository(name=repository.name).result(timeout=30)
    with pytest.raises(gexc.NotFound):
        registry.get_repository(name=repository.name)
    with pytest.raises(gexc.NotFound):
        registry.get_docker_image(name=f"{repository.name}/dockerImages/trainer@sha256:{'0' * 64}")


@pytest.mark.parametrize(("target", "status"), [
    ("cloudbuild.googleapis.com:443", b"200"), ("us-central1-cloudbuild.googleapis.com:443", b"200"),
    ("artifactregistry.googleapis.com:443", b"200"), ("storage.googleapis.com:443", b"403"),
    ("cloudbuild.googleapis.com:80", b"403"),
])
def test_the_google_endpoint_proxy_leads_cloud_build_and_artifact_registry_here(emulator, target, status):
    from .test_grpc import _proxy_answer

    answer = _proxy_answer(emulator, f"CONNECT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    assert answer.split(b" ")[1] == status, answer
