"""Preemption through the real run_v2 REST clients: the emulator's preempt endpoint (by execution
and task index or by task name) and its seeded preemption schedule; SIGTERM, the grace period,
SIGKILL, exit 143 and the retry that follows, as Cloud Run reports them."""

from __future__ import annotations

import datetime as dt
import json
import time

import pytest
from google.api_core import exceptions as gexc

from cloud_run_emulator.models import PREEMPTION_MESSAGE

from .conftest import _read, create, make_job, task_name, wait_running


def test_preemption_exit_143_is_retried_into_success(jobs, tasks, emulator, bucket, job_id):
    job = create(jobs, job_id, make_job("local/sleep:1", env={"OUT": "/checkpoints"}, bucket=bucket.name))
    op = jobs.run_job(name=job.name)
    wait_running(tasks, task_name(op.metadata.name, 0))
    answer = emulator.preempt(op.metadata.name, 0, grace_seconds=5)
    assert answer["attempt"] == 0 and answer["task"] == task_name(op.metadata.name, 0) and answer["pid"] > 0
    execution = op.result(timeout=30)
    assert execution.succeeded_count == 1 and execution.retried_count == 1
    task = tasks.get_task(name=task_name(execution.name, 0))
    assert task.retried >= 1 and task.last_attempt_result.status.code == 0
    root = emulator.bucket_dir(bucket.name) / "task-0"
    assert json.loads((root / "attempt-0.json").read_text())["interrupted"] is True
    logs = _read(task.log_uri).decode()  # each attempt's output, kept apart, behind logUri
    first, second_log = logs.split("==> task0-attempt1.log <==")
    assert first.startswith("==> task0-attempt0.log <==") and "SIGTERM received, exiting 143" in first
    assert "done" in second_log and "SIGTERM" not in second_log
    first_attempt, second_attempt = emulator.attempts(execution.name)
    assert (first_attempt["attempt"], first_attempt["exitCode"], first_attempt["stopReason"]) == (0, 143, "preempted")
    assert first_attempt["statusCode"] == 14 and first_attempt["log"] == "task0-attempt0.log"
    assert (second_attempt["attempt"], second_attempt["exitCode"], second_attempt["statusCode"]) == (1, 0, 0)
    assert second_attempt["stopReason"] is None and first_attempt["endTime"] <= second_attempt["startTime"]
    # the record and the API read one clock for an attempt: the task's start_time is its process's start
    assert dt.datetime.fromisoformat(second_attempt["startTime"]) == task.start_time
    second = json.loads((root / "attempt-1.json").read_text())
    assert second["CLOUD_RUN_TASK_ATTEMPT"] == "1" and second["interrupted"] is False


def test_preemption_without_retries_records_exit_143_and_maintenance_status(jobs, tasks, emulator, job_id):
    job = create(jobs, job_id, make_job("local/sleep:1", max_retries=0))
    op = jobs.run_job(name=job.name)
    wait_running(tasks, task_name(op.metadata.name, 0))
    emulator.preempt(op.metadata.name, 0)
    with pytest.raises(gexc.FailedPrecondition):
        op.result(timeout=30)
    result = tasks.get_task(name=task_name(op.metadata.name, 0)).last_attempt_result
    assert result.exit_code == 143 and result.term_signal == 0
    assert result.status.code == 14 and result.status.message == PREEMPTION_MESSAGE


def test_preemption_of_a_process_ignoring_sigterm_ends_in_sigkill(jobs, tasks, emulator, job_id):
    job = create(jobs, job_id, make_job("local/stubborn", max_retries=0))
    op = jobs.run_job(name=job.name)
    wait_running(tasks, task_name(op.metadata.name, 0))
    started = time.monotonic()
    emulator.preempt(op.metadata.name, 0, grace_seconds=0.5)
    with pytest.raises(gexc.FailedPrecondition):
        op.result(timeout=30)
    assert time.monotonic() - started >= 0.5
    result = tasks.get_task(name=task_name(op.metadata.name, 0)).last_attempt_result
    assert result.term_signal == 9 and result.exit_code == 0 and result.status.code == 14


def test_preempt_by_task_name_and_wildcard_task_listing(jobs, tasks, emulator, job_id):
    from cloud_run_emulator.process import post_json

    job = create(jobs, job_id, make_job("local/sleep:1", task_count=2, env={"SLEEP": "3"}))
    op = jobs.run_job(name=job.name)
    name = task_name(op.metadata.name, 1)
    wait_running(tasks, name)
    answer = post_json(emulator.endpoint + "/_emulator/preempt", {"task": name, "graceSeconds": 5})
    assert answer["task"] == name and answer["attempt"] == 0
    execution = op.result(timeout=30)
    assert execution.succeeded_count == 2 and execution.retried_count == 1
    listed = list(tasks.list_tasks(parent=f"{job.name}/executions/-"))
    assert sorted(t.name for t in listed) == [task_name(execution.name, 0), name]
    assert [t.retried for t in listed if t.name == name] == [1]
    missing = post_json(emulator.endpoint + "/_emulator/preempt", {"task": name})
    assert missing["error"]["status"] == "FAILED_PRECONDITION"


def test_seeded_preemption_schedule_over_http(jobs, tasks, executions, emulator, job_id):
    from cloud_run_emulator.process import post_json

    spec = make_job("local/sleep:1", task_count=2, env={"SLEEP": "30", "FAST_FROM": "9"}, max_retries=5)
    job = create(jobs, job_id, spec)
    op = jobs.run_job(name=job.name)
    wait_running(tasks, task_name(op.metadata.name, 0))
    started = emulator.schedule_preemptions(0.2, seed=5, name_prefix=job.name + "/", grace_seconds=2,
                                            max_preemptions=2)
    assert started["active"] and started["plan"]["meanSeconds"] == 0.2 and started["preemptions"] == []
    deadline = time.monotonic() + 20
    while (status := emulator.preemption_schedule())["active"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert len(status["preemptions"]) == 2
    assert all(p["task"] in {task_name(op.metadata.name, i) for i in (0, 1)} for p in status["preemptions"])
    deadline = time.monotonic() + 20
    while sum(t.retried for t in tasks.list_tasks(parent=op.metadata.name)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    executions.cancel_execution(name=op.metadata.name).result(timeout=30)
    bad = post_json(emulator.endpoint + "/_emulator/preemptions/schedule", {"meanSeconds": -1})
    assert bad["error"]["status"] == "INVALID_ARGUMENT" and "meanSeconds" in bad["error"]["message"]
    assert emulator.preemption_schedule(stop=True)["active"] is False
