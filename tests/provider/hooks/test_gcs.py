"""CheckpointBucketHook against the embedded GCS emulator, with the real google-cloud-storage client.

What the emulator shows (and so what these tests can tell apart): bucket labels are stored and
returned (set at insert they are dropped, set by a patch they stay, the hook covers both);
every bucket has the same ``projectNumber`` and listing ignores the project, so "another
project" is told here by the ``gcp-project`` label, and on Cloud Storage also by the listing.
"""

from __future__ import annotations

import uuid

import pytest
from airflow.providers.google.cloud.hooks.gcs import GCSHook
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from airflow_gpu_resilience.exceptions import CheckpointBucketNotOursError
from airflow_gpu_resilience.hooks.gcs import DELETE_BATCH_SIZE, CheckpointBucketHook, ownership_labels
from tests.provider.conftest import PROJECT, REGION


@pytest.fixture
def transport() -> str:
    """One transport: these hooks talk to Cloud Storage only, which the Cloud Run transport
    (the conftest's ``transport``) does not reach."""
    return "grpc"


@pytest.fixture
def client(emulator) -> storage.Client:
    return storage.Client(project=PROJECT, credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": emulator.gcs_endpoint})


@pytest.fixture
def hook(gcp_conn, gcs_emulator_host) -> CheckpointBucketHook:
    return CheckpointBucketHook(gcp_conn_id=gcp_conn)


@pytest.fixture
def name() -> str:
    return f"ckpt-{uuid.uuid4().hex[:12]}"


def _bucket(client: storage.Client, name: str, labels: dict | None = None, objects: int = 0, size: int = 10):
    bucket = client.create_bucket(name)
    if labels:
        bucket.labels = labels
        bucket.patch()
    for i in range(objects):
        bucket.blob(f"job/run/task-0/ckpt-{i:08d}.pt").upload_from_string(b"x" * size)
    return bucket


def test_a_new_bucket_is_created_with_the_ownership_labels(hook, client, name):
    result = hook.ensure_bucket(bucket_name=name, project_id=PROJECT, location=REGION)
    assert result["created"] is True and result["bucket"] == name
    assert client.get_bucket(name).labels == ownership_labels(PROJECT) == result["labels"]


def test_a_domain_scoped_project_id_becomes_a_valid_label_value():
    assert ownership_labels("example.com:My-Proj")["gcp-project"] == "example_com_my-proj"


def test_our_bucket_from_an_earlier_run_is_used(hook, client, name):
    hook.ensure_bucket(bucket_name=name, project_id=PROJECT, location=REGION)
    again = hook.ensure_bucket(bucket_name=name, project_id=PROJECT, location=REGION)
    assert again["created"] is False and again["labels"]["managed-by"] == "airflow-gpu-resilience"


def test_a_bucket_adopted_by_adding_the_label_is_used(hook, client, name):
    _bucket(client, name, labels={"managed-by": "airflow-gpu-resilience"})
    assert hook.ensure_bucket(bucket_name=name, project_id=PROJECT, location=REGION)["created"] is False


@pytest.mark.parametrize(
    ("labels", "reason"),
    [
        (None, "it has no label managed-by=airflow-gpu-resilience"),
        ({"team": "vision"}, "it has no label managed-by=airflow-gpu-resilience"),
        ({"managed-by": "someone-else"}, "it has no label managed-by=airflow-gpu-resilience"),
        ({"managed-by": "airflow-gpu-resilience", "gcp-project": "other-project"},
         "gcp-project=other-project names another project"),
    ],
)
def test_someone_elses_bucket_fails_clearly_and_is_left_as_it_is(hook, client, name, labels, reason):
    before = _bucket(client, name, labels=labels, objects=1)
    with pytest.raises(CheckpointBucketNotOursError) as raised:
        hook.ensure_bucket(bucket_name=name, project_id=PROJECT, location=REGION)
    message = str(raised.value)
    assert f"Bucket '{name}' already exists" in message and reason in message
    assert "Choose another `bucket` param" in message and "--update-labels=managed-by=airflow-gpu-resilience" in message
    assert raised.value.bucket == name
    after = client.get_bucket(name)
    assert after.labels == before.labels and after.metageneration == before.metageneration
    assert [b.name for b in client.list_blobs(name)] == ["job/run/task-0/ckpt-00000000.pt"]


def test_the_clients_forced_delete_refuses_a_real_checkpoint_bucket(client, name, gcs_emulator_host, gcp_conn):
    """What cleanup used to call: ``GCSHook.delete_bucket(force=True)`` stops at 256 objects."""
    _bucket(client, name, labels=ownership_labels(PROJECT), objects=300)
    with pytest.raises(ValueError, match="more than 256"):
        GCSHook(gcp_conn_id=gcp_conn).delete_bucket(bucket_name=name, force=True)
    assert client.lookup_bucket(name) is not None


def test_delete_removes_300_objects_in_batches_then_the_bucket(hook, client, name, capsys):
    _bucket(client, name, labels=ownership_labels(PROJECT), objects=300, size=7)
    result = hook.delete_bucket_and_contents(bucket_name=name, project_id=PROJECT)
    assert result == {"bucket": name, "deleted": True, "objects_deleted": 300, "bytes_deleted": 2100}
    assert client.lookup_bucket(name) is None
    logged = capsys.readouterr().out  # the hook logs through Airflow's (structlog) handler
    assert f"Deleted bucket {name}: 300 objects, 2100 bytes" in logged
    rounds = [n for n in (100, 200, 300) if f"{n} objects ({n * 7} bytes) deleted so far" in logged]
    assert rounds == [100, 200, 300] and DELETE_BATCH_SIZE == 100


def test_delete_of_a_missing_bucket_reports_nothing_deleted(hook, name):
    assert hook.delete_bucket_and_contents(bucket_name=name, project_id=PROJECT) == {
        "bucket": name, "deleted": False, "objects_deleted": 0, "bytes_deleted": 0}


def test_delete_refuses_a_bucket_that_is_not_ours(hook, client, name):
    _bucket(client, name, objects=3)
    with pytest.raises(CheckpointBucketNotOursError, match="no label managed-by"):
        hook.delete_bucket_and_contents(bucket_name=name, project_id=PROJECT)
    assert len(list(client.list_blobs(name))) == 3


def test_empty_names_are_refused_before_any_call(hook):
    with pytest.raises(ValueError, match="bucket_name and project_id"):
        hook.ensure_bucket(bucket_name="", project_id=PROJECT, location=REGION)
