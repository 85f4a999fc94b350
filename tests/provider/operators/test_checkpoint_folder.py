"""The execute operator reads the task folders where the worker writes them.

The worker's task folder is ``{job}/{CHECKPOINT_RUN_ID}/task-N`` when the job sets
``CHECKPOINT_RUN_ID`` (a run level, e.g. a fresh one after changing the training's settings);
without ``checkpoint_prefix`` the operator follows the job's variable, so its progress, lost work,
re-run budget and goodput account come from this run's folder, not from an older run's.
"""

from __future__ import annotations

import json

import pytest

from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuExecuteJobOperator
from tests.provider.conftest import BUCKET, REGION, bucket_dir
from tests.provider.operators.test_progress_reruns import (  # noqa: F401 - worker_emulator is a fixture
    WORKER_IMAGE, _TI, deploy, worker_emulator,
)

pytestmark = pytest.mark.usefixtures("airflow_db")


def test_the_task_folders_follow_the_jobs_run_id(worker_emulator, job_name):
    older = bucket_dir(worker_emulator) / job_name / "task-0"  # an older run's folder, without a run level
    older.mkdir(parents=True)
    (older / "progress.json").write_text(json.dumps({"step": 999, "total_steps": 999, "status": "completed"}))
    deploy(job_name, WORKER_IMAGE, ["train", "--steps", "30", "--step-delay", "0.01", "--checkpoint-every", "10"],
           env={"CHECKPOINT_RUN_ID": "run-7"})
    op = CloudRunGpuExecuteJobOperator(task_id="execute", job_name=job_name, region=REGION, deferrable=False,
                                       poll_interval=0.5, checkpoint_bucket=BUCKET)
    summary = op.execute({"ti": _TI()})
    assert (bucket_dir(worker_emulator) / job_name / "run-7" / "task-0" / "progress.json").exists()
    assert summary["progress"]["0"]["step"] == 30 and summary["progress"]["0"]["total_steps"] == 30
    [account] = summary["goodput"]["tasks"]
    assert account["productive"] > 0 and account["attempts"][0]["reached_first_step"]
