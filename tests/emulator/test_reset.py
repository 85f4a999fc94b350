"""``POST /_emulator/reset`` forgets every resource the emulator holds: Cloud Run's, and Cloud
Build's builds and Artifact Registry's repositories with the images pushed there (they leave the
image table: a job naming one no longer runs). The image table file's own entries and Cloud
Storage stay. An emulator of this module's own, since a reset ends everything the session's runs.
"""

from __future__ import annotations

import json
import uuid

import grpc
import pytest
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import artifactregistry_v1 as ar
from google.cloud import run_v2, storage
from google.cloud.artifactregistry_v1.services.artifact_registry.transports import ArtifactRegistryGrpcTransport
from google.cloud.devtools import cloudbuild_v1 as cb
from google.cloud.devtools.cloudbuild_v1.services.cloud_build.transports import CloudBuildGrpcTransport
from google.cloud.run_v2.services.jobs.transports import JobsGrpcTransport

from cloud_run_emulator.process import EmulatorProcess, post_json

from .conftest import make_job
from .test_cloud_build import PARENT, PROJECT, docker_build, source_files

TRUE_IMAGE = "local/true"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reset-emulator")
    (folder / "images.json").write_text(json.dumps({"images": {TRUE_IMAGE: {"entrypoint": ["true"]}}}))
    with EmulatorProcess(folder / "state", images_file=folder / "images.json", grace_seconds=1.0) as emu:
        yield emu


@pytest.fixture(scope="module")
def channel(emulator):
    channel = grpc.insecure_channel(emulator.grpc_endpoint)
    yield channel
    channel.close()


def _run(jobs: run_v2.JobsClient, image: str) -> run_v2.Execution:
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    jobs.create_job(parent=PARENT, job_id=job_id, job=make_job(image, max_retries=0)).result(timeout=30)
    return jobs.run_job(name=f"{PARENT}/jobs/{job_id}").result(timeout=60)


def test_reset_forgets_builds_repositories_and_pushed_images(emulator, channel):
    builds = cb.CloudBuildClient(transport=CloudBuildGrpcTransport(channel=channel))
    registry = ar.ArtifactRegistryClient(transport=ArtifactRegistryGrpcTransport(channel=channel))
    jobs = run_v2.JobsClient(transport=JobsGrpcTransport(channel=channel))
    bucket = storage.Client(project=PROJECT, credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": emulator.gcs_endpoint}).create_bucket("reset-sources")
    repository = registry.create_repository(parent=PARENT, repository_id="images", repository=ar.Repository(
        format_=ar.Repository.Format.DOCKER)).result(timeout=30)
    uri = f"{repository.registry_uri}/trainer:v1"
    build = builds.create_build(parent=PARENT, project_id=PROJECT,
                                build=docker_build(bucket, source_files(), uri)).result(timeout=60)
    by_digest = f"{repository.registry_uri}/trainer@{build.results.images[0].digest}"
    assert _run(jobs, by_digest).succeeded_count == 1  # the pushed image is in the image table

    post_json(emulator.endpoint + "/_emulator/reset", {})

    assert list(registry.list_repositories(parent=PARENT)) == []
    with pytest.raises(gexc.NotFound):
        registry.get_repository(name=repository.name)
    assert list(builds.list_builds(request={"parent": PARENT, "project_id": PROJECT})) == []
    with pytest.raises(gexc.NotFound):
        builds.get_build(project_id=PROJECT, id=build.id)
    with pytest.raises(gexc.GoogleAPICallError, match="not in the emulator's image table"):
        _run(jobs, by_digest)  # the pushed image left the table with its repository
    assert _run(jobs, TRUE_IMAGE).succeeded_count == 1  # the table file's entries stay
    assert bucket.exists()  # Cloud Storage stays without {"gcs": true}
    # the names are free again
    registry.create_repository(parent=PARENT, repository_id="images", repository=ar.Repository(
        format_=ar.Repository.Format.DOCKER)).result(timeout=30)
