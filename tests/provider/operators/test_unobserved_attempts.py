"""Attempts that no poll saw are classed from the worker's own record, not left ``UNOBSERVED``.

Cloud Run keeps only the latest attempt's result of a task. When attempts end and are retried
while nothing reads the API (a triggerer restart, an API outage, a long poll interval), the
result of each but the last is gone by the next read. The bundled worker writes how each of its
attempts ended (its goodput events file, with the exit code), and with ``checkpoint_bucket`` set
the execute operator reads it for those attempts. Here two maintenance preemptions land while
the execute operator is deferred and its trigger not yet running; the trigger's first read sees
the finished execution only.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from airflow.exceptions import TaskDeferred

from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuExecuteJobOperator
from tests.provider.conftest import BUCKET, REGION, bucket_dir
from tests.provider.operators.test_progress_reruns import (  # noqa: F401 - worker_emulator is a fixture
    WORKER_IMAGE, _TI, deploy, worker_emulator,
)

pytestmark = [pytest.mark.usefixtures("airflow_db"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def wait_for_steps(folder: Path, execution: str, attempt: int, steps: int, timeout: float = 120.0) -> None:
    """Until the worker's events file of ``attempt`` records at least ``steps`` steps."""
    path = folder / f"goodput-{execution}-{attempt}.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads(path.read_text()).get("steps", 0) >= steps:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{path.name} never recorded {steps} steps")


def test_attempts_retried_while_nothing_polled_are_classed_from_the_workers_record(worker_emulator, job_name):
    deploy(job_name, WORKER_IMAGE, ["train", "--steps", "120", "--step-delay", "0.03", "--checkpoint-every", "10"],
           max_retries=3)
    op = CloudRunGpuExecuteJobOperator(task_id="execute", job_name=job_name, region=REGION, deferrable=True,
                                       poll_interval=0.2, checkpoint_bucket=BUCKET)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({"ti": _TI()})
    trigger = deferred.value.trigger
    short = trigger.execution.rsplit("/", 1)[-1]
    folder = bucket_dir(worker_emulator) / job_name / "task-0"
    for attempt in (0, 1):  # nothing watches: the trigger is not running yet
        wait_for_steps(folder, short, attempt, 5)
        assert worker_emulator.preempt(trigger.execution, task_index=0)["attempt"] == attempt
    hook = CloudRunGpuHook()
    deadline = time.monotonic() + 180
    while not hook.get_execution(execution=trigger.execution).completion_time:
        assert time.monotonic() < deadline, "the execution did not finish"
        time.sleep(0.5)

    async def first_event():
        return await anext(trigger.run())

    event = asyncio.run(asyncio.wait_for(first_event(), timeout=60)).payload
    assert [a["observed"] for a in event["attempts"]] == [False, False, True]  # the API kept the last only
    summary = op.execute_complete({"ti": _TI()}, event)

    [task] = summary["tasks"]
    assert task["outcomes"] == ["PREEMPTED", "PREEMPTED", "SUCCEEDED"], task
    assert task["exit_codes"] == [143, 143, 0], task
    recorded = worker_emulator.attempts(trigger.execution)
    assert [a["stopReason"] for a in recorded] == ["preempted", "preempted", None]
