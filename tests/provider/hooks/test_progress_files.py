"""CheckpointFilesHook against the embedded GCS emulator: a forged ``progress.json`` is not believed."""

from __future__ import annotations

import json
import uuid

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from airflow_gpu_resilience.hooks.progress import CheckpointFilesHook
from tests.provider.conftest import BUCKET, PROJECT
from tests.unit.test_progress_files import warned  # noqa: F401 - a fixture: the module's warnings


@pytest.fixture
def transport() -> str:
    """One transport: this hook reads Cloud Storage only, which the Cloud Run transport (the
    conftest's ``transport``) does not reach."""
    return "grpc"


def test_a_step_of_10_to_the_12_in_progress_json_bounds_the_lost_work(emulator, gcp_conn, gcs_emulator_host, warned):
    """The worker believed a ``progress.json`` claiming step 10**12 and wrote that it lost
    999999999910 steps; the run has 100, and the attempt resumed from step 90: at most 10."""
    prefix = f"job-{uuid.uuid4().hex[:8]}"
    bucket = storage.Client(project=PROJECT, credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": emulator.gcs_endpoint}).bucket(BUCKET)
    files = {"progress.json": {"step": 10**12, "total_steps": 100, "status": "running"},
             "attempts.json": {"attempts": [{"execution": "job-x", "attempt": 1, "task_index": 0,
                                             "resumed_from_step": 90, "lost_steps": 999999999910}]}}
    for name, content in files.items():
        bucket.blob(f"{prefix}/task-0/{name}").upload_from_string(json.dumps(content))
    hook = CheckpointFilesHook(BUCKET, prefix, gcp_conn_id=gcp_conn)
    lost = hook.lost_work(0)
    progress = hook.progress(0)
    assert [item["lost_steps"] for item in lost] == [10]
    assert progress is not None and progress.step == 100
    messages = warned
    assert f"gs://{BUCKET}/{prefix}/task-0/attempts.json: lost_steps 999999999910 of execution job-x attempt 1 " \
           "(resumed from step 90) is more than the run's total_steps 100 allows; counted as 10" in messages
    assert f"gs://{BUCKET}/{prefix}/task-0/progress.json: step 1000000000000 is beyond total_steps 100; " \
           "shown as 100" in messages


def test_every_task_folder_fixture_reads_through_the_bucket_as_expected(emulator, gcp_conn, gcs_emulator_host):
    """The shared task-folder fixtures (``tests/fixtures/task_folders``), each uploaded as one task
    of a job, read in one listing: the committed steps and the newer release's record that each
    fixture's ``expected.json`` gives (the worker's verifiers give the same); ``committed_steps``
    is the newest of each."""
    from tests.fixtures.task_folders.make_task_folders import fixtures
    from tests.unit.test_task_folder_records import answers

    prefix = f"job-{uuid.uuid4().hex[:8]}"
    bucket = storage.Client(project=PROJECT, credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": emulator.gcs_endpoint}).bucket(BUCKET)
    cases = fixtures()
    for index, (_, folder, _) in enumerate(cases):
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            bucket.blob(f"{prefix}/task-{index}/{path.relative_to(folder)}").upload_from_string(path.read_bytes())
    hook = CheckpointFilesHook(BUCKET, prefix, gcp_conn_id=gcp_conn)
    tasks = hook.task_checkpoints()
    assert tasks is not None
    for index, (name, _, expected) in enumerate(cases):
        assert answers(tasks[index]) == {k: expected[k] for k in ("valid_steps", "newest_step", "fatal")}, name
    assert hook.committed_steps() == {i: c[2]["newest_step"] for i, c in enumerate(cases) if c[2]["newest_step"]}
