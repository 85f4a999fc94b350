"""The rollback case with real processes: the bundled worker finds a commit record of a newer
release in its task folder (as after the job's image was rolled back), refuses it with exit 78
and a ``FATAL`` marker, and the execute operator fails the Airflow task as FATAL with the
worker's reason, naming the record and its version, without a re-run; the newer checkpoint and
its record are left as they were. About 10 s per case (an emulator of its own, two short
attempts of the worker). The run manager's read of the worker's files for it
(:meth:`~airflow_gpu_resilience.run_progress.CheckpointProgress.worker_reasons`) through the GCS
emulator: with and without a marker, and from a bucket that cannot be read.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from pathlib import Path

import pytest

from airflow_gpu_resilience.exceptions import CloudRunGpuFatalError
from airflow_gpu_resilience.hooks.progress import CheckpointFilesHook
from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuExecuteJobOperator
from airflow_gpu_resilience.outcome import OutcomeClass, TaskOutcome
from airflow_gpu_resilience.run_progress import FATAL_FILE, CheckpointProgress
from tests.provider.conftest import BUCKET, PROJECT, REGION, bucket_dir
from tests.provider.operators.test_progress_reruns import (  # noqa: F401 - worker_emulator is a fixture
    WORKER_IMAGE,
    _TI,
    deploy,
    executions,
    worker_emulator,
)

pytestmark = pytest.mark.usefixtures("airflow_db")

#: A task folder whose newest record (``ckpt-00000020.commit.json``) has format 99, beside a
#: format-1 checkpoint at step 10 (the worker's shared fixture, ``expected.json`` says so).
NEWER_FORMAT = Path(__file__).resolve().parents[2] / "fixtures" / "task_folders" / "newer_format" / "task-0"


@pytest.mark.parametrize("fatal_exit_codes", [None, [65, 70]], ids=["default-fatal-codes", "78-not-among-them"])
def test_a_rolled_back_worker_fails_the_task_as_fatal_naming_the_newer_record(worker_emulator, job_name,
                                                                             fatal_exit_codes):
    """Issue 35, must-show 3: exit 78 on both attempts (Cloud Run's retry obeys the marker), one
    execution only, CloudRunGpuFatalError (FATAL) whose message carries the worker's reason:
    the record's name and its format; the newer checkpoint's bytes are untouched. Also FATAL when
    the user's ``fatal_exit_codes`` leave 78 out (a newer release's record is never retryable)."""
    folder = bucket_dir(worker_emulator) / job_name / "task-0"
    shutil.copytree(NEWER_FORMAT, folder)
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    deploy(job_name, WORKER_IMAGE, ["train", "--steps", "40", "--checkpoint-every", "10"], max_retries=1)
    extra = {} if fatal_exit_codes is None else {"fatal_exit_codes": fatal_exit_codes}
    op = CloudRunGpuExecuteJobOperator(task_id="execute", job_name=job_name, region=REGION, deferrable=False,
                                       poll_interval=0.2, checkpoint_bucket=BUCKET, max_preemption_reruns=3, **extra)
    with pytest.raises(CloudRunGpuFatalError) as raised:
        op.execute({"ti": _TI()})

    error, message = raised.value, str(raised.value)
    assert (error.outcome, error.exit_code) == ("FATAL", 78), message
    assert "ckpt-00000020.commit.json has format 99" in message, message
    assert "a newer release of the worker wrote it" in message, message
    [execution] = executions(job_name)  # no re-run was started
    assert error.execution == execution.name
    assert [a["exitCode"] for a in worker_emulator.attempts(execution.name)] == [78, 78]
    assert {path.name: path.read_bytes() for path in folder.iterdir() if path.name != "FATAL"} == before


def _task(index: int, outcome: OutcomeClass, exit_code: int) -> TaskOutcome:
    return TaskOutcome(index=index, attempts=1, outcome=outcome, exit_code=exit_code)


@pytest.mark.parametrize("transport", ["rest"], indirect=True)  # Cloud Storage only: one transport is enough
def test_worker_reasons_are_read_from_the_markers_and_the_task_folders(emulator, gcp_conn, gcs_emulator_host):
    """Task 0: the newer record and no marker (the provider's reading of the folder); task 1: the
    worker's marker as well (its words); task 2: a divergence marker (exit 70, its reason, its
    class kept); task 3: preempted beside a newer record (never read, unchanged). A bucket that
    cannot be read leaves every task as it was."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    prefix = f"job-{uuid.uuid4().hex[:8]}"
    bucket = storage.Client(project=PROJECT, credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": emulator.gcs_endpoint}).bucket(BUCKET)
    for index in (0, 1, 3):
        for path in NEWER_FORMAT.iterdir():
            bucket.blob(f"{prefix}/task-{index}/{path.name}").upload_from_string(path.read_bytes())
    marker = {"exit_code": 78, "reason": "commit record /c/ckpt-00000020.commit.json has format 99 (...)",
              "newer_record": {"file": "/c/ckpt-00000020.commit.json", "format": 99, "digest": None}}
    bucket.blob(f"{prefix}/task-1/{FATAL_FILE}").upload_from_string(json.dumps(marker))
    bucket.blob(f"{prefix}/task-2/{FATAL_FILE}").upload_from_string(json.dumps({"exit_code": 70, "reason": "nan"}))
    tasks = [_task(0, OutcomeClass.FAILED, 78), _task(1, OutcomeClass.FAILED, 78), _task(2, OutcomeClass.FAILED, 70),
             _task(3, OutcomeClass.PREEMPTED, 143)]

    found = CheckpointProgress(CheckpointFilesHook(BUCKET, prefix, gcp_conn_id=gcp_conn),
                               logging.getLogger(__name__)).worker_reasons(tasks, timeout=5)
    assert [(t.outcome, t.reason) for t in found] == [
        (OutcomeClass.FATAL, "commit record ckpt-00000020.commit.json has format 99, written by a newer worker "
                             "release than the one that ran (was its image rolled back?); it refuses the folder "
                             "rather than lose that checkpoint"),
        (OutcomeClass.FATAL, marker["reason"]),
        (OutcomeClass.FAILED, "nan"),
        (OutcomeClass.PREEMPTED, ""),
    ]
    unreadable = CheckpointProgress(CheckpointFilesHook(f"no-such-bucket-{prefix}", prefix, gcp_conn_id=gcp_conn),
                                    logging.getLogger(__name__))
    assert unreadable.worker_reasons(tasks, timeout=0) == tasks
