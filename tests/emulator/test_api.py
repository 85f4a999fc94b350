"""Black-box tests: the real run_v2 REST clients against the emulator subprocess: a job's and an
execution's life (create, run, retry, time out, cancel, override, list, update, delete). Preemption
is in ``test_api_preemption.py``, error answers and injected API faults in ``test_api_errors.py``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from google.api import launch_stage_pb2
from google.api_core import exceptions as gexc
from google.cloud import run_v2

from .conftest import PARENT, create, google_status, make_job, poll_execution, task_name, wait_running

State = run_v2.Condition.State


def test_gpu_job_with_gcs_volume_runs_to_success(jobs, executions, tasks, emulator, bucket, job_id):
    spec = make_job("local/exit:latest", env={"OUT": "/checkpoints/out", "SLEEP": "0.3"}, max_retries=3,
                    bucket=bucket.name, gpu=True, args=["--out=/checkpoints/x"], timeout_s=2 * 3600,
                    launch_stage=launch_stage_pb2.BETA)
    job = create(jobs, job_id, spec)
    assert job.name == f"{PARENT}/jobs/{job_id}" and job.generation == 1 and job.uid
    assert job.terminal_condition.state == State.CONDITION_SUCCEEDED
    assert job.template.template.gpu_zonal_redundancy_disabled is True
    assert job.template.template.node_selector.accelerator == "nvidia-l4"
    assert job.template.template.max_retries == 3 and job.template.task_count == 1
    assert job.template.template.timeout.total_seconds() == 7200 and job.launch_stage == launch_stage_pb2.BETA

    op = jobs.run_job(name=job.name)
    assert op.metadata.name.startswith(f"{job.name}/executions/{job_id}-")
    assert executions.get_execution(name=op.metadata.name).reconciling  # still running
    execution = poll_execution(executions, op.metadata.name)
    assert op.result(timeout=10).succeeded_count == 1 and not op.operation.HasField("error")
    assert execution.succeeded_count == 1 and execution.failed_count == 0
    assert execution.running_count == 0 and execution.retried_count == 0 and execution.cancelled_count == 0
    assert [c.type_ for c in execution.conditions] == ["ResourcesAvailable", "Started", "Completed"]
    assert all(c.state == State.CONDITION_SUCCEEDED for c in execution.conditions)
    assert execution.completion_time and execution.start_time and execution.job == job_id
    assert not execution.reconciling

    task = tasks.get_task(name=task_name(execution.name, 0))
    assert task.index == 0 and task.retried == 0 and task.last_attempt_result.status.code == 0
    assert task.last_attempt_result.exit_code == 0 and task.last_attempt_result.term_signal == 0
    record = json.loads((emulator.bucket_dir(bucket.name) / "out/task-0/attempt-0.json").read_text())
    assert record["CLOUD_RUN_JOB"] == job_id and record["CLOUD_RUN_TASK_COUNT"] == "1"
    assert record["CLOUD_RUN_EXECUTION"] == execution.name.rsplit("/", 1)[-1]
    assert record["argv"] == [f"--out={emulator.volume_dir(bucket.name)}/x"]  # args replace cmd, path rewritten

    refreshed = jobs.get_job(name=job.name)
    assert refreshed.execution_count == 1
    assert refreshed.latest_created_execution.name == execution.name
    assert refreshed.latest_created_execution.completion_status == \
        run_v2.ExecutionReference.CompletionStatus.EXECUTION_SUCCEEDED
    with urllib.request.urlopen(execution.log_uri) as response:
        assert b"attempt 0 exiting 0" in response.read()


def test_failing_task_is_retried_then_fails_the_execution(jobs, executions, tasks, emulator, job_id):
    job = create(jobs, job_id, make_job("local/exit:latest", env={"CODE": "1"}, max_retries=1))
    op = jobs.run_job(name=job.name)
    with pytest.raises(gexc.FailedPrecondition, match="task0 failed with message"):
        op.result(timeout=30)
    assert op.operation.done and op.operation.error.code == 9  # the RunJob LRO carries `error`
    assert "task0 failed with message" in op.operation.error.message
    execution = executions.get_execution(name=op.metadata.name)
    assert execution.failed_count == 1 and execution.succeeded_count == 0 and execution.retried_count == 1
    completed = execution.conditions[-1]
    assert completed.state == State.CONDITION_FAILED
    assert completed.execution_reason == run_v2.Condition.ExecutionReason.NON_ZERO_EXIT_CODE
    task = tasks.get_task(name=task_name(execution.name, 0))
    assert task.retried == 1
    assert task.last_attempt_result.exit_code == 1 and task.last_attempt_result.status.code != 0
    assert [(a["attempt"], a["exitCode"]) for a in emulator.attempts(task.name)] == [(0, 1), (1, 1)]
    assert jobs.get_job(name=job.name).latest_created_execution.completion_status == \
        run_v2.ExecutionReference.CompletionStatus.EXECUTION_FAILED
    # the attempt record outlives the job (a DAG's cleanup deletes it before a report reads it)
    recorded = emulator.attempts(execution.name)
    jobs.delete_job(name=job.name).result(timeout=10)
    with pytest.raises(gexc.NotFound):
        executions.get_execution(name=execution.name)
    assert emulator.attempts(execution.name) == recorded and len(recorded) == 2
    assert [a["attempt"] for a in emulator.attempts(task.name)] == [0, 1]


def test_three_tasks_parallelism_two_write_into_the_bucket(jobs, tasks, emulator, storage_client, bucket, job_id):
    spec = make_job("local/exit:latest", env={"OUT": f"/checkpoints/{job_id}", "SLEEP": "0.5"},
                    task_count=3, parallelism=2, bucket=bucket.name)
    job = create(jobs, job_id, spec)
    execution = jobs.run_job(name=job.name).result(timeout=30)
    assert execution.succeeded_count == 3 and execution.task_count == 3 and execution.parallelism == 2
    listed = list(tasks.list_tasks(parent=execution.name))
    assert [t.index for t in listed] == [0, 1, 2]
    blobs = sorted(b.name for b in storage_client.list_blobs(bucket.name))
    assert blobs == [f"{job_id}/task-{i}/attempt-0.json" for i in range(3)]
    records = [json.loads(storage_client.bucket(bucket.name).blob(name).download_as_bytes()) for name in blobs]
    assert [r["CLOUD_RUN_TASK_INDEX"] for r in records] == ["0", "1", "2"]
    assert all(r["CLOUD_RUN_TASK_ATTEMPT"] == "0" and r["CLOUD_RUN_TASK_COUNT"] == "3" for r in records)
    events = sorted([(r["start"], 1) for r in records] + [(r["end"], -1) for r in records])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak == 2


def test_mount_and_storage_api_see_the_same_objects(emulator, storage_client, bucket):
    bucket.blob("input/data.txt").upload_from_string("hello")
    root = emulator.bucket_dir(bucket.name)
    assert (root / "input/data.txt").read_text() == "hello"
    (root / "run").mkdir()
    (root / "run/progress.json").write_text('{"step": 1}')  # as a running task writes it
    assert bucket.blob("run/progress.json").download_as_bytes() == b'{"step": 1}'
    (root / "run/progress.json").write_text('{"step": 2}')  # same size, new content
    assert bucket.blob("run/progress.json").download_as_bytes() == b'{"step": 2}'  # hashes follow
    (root / "input/data.txt").unlink()
    assert sorted(b.name for b in storage_client.list_blobs(bucket.name)) == ["run/progress.json"]


def test_attempt_timeout_stops_the_attempt(jobs, tasks, job_id):
    job = create(jobs, job_id, make_job("local/sleep:1", max_retries=0, timeout_s=1))
    op = jobs.run_job(name=job.name)
    with pytest.raises(gexc.FailedPrecondition, match="exceeded its timeout"):
        op.result(timeout=30)
    result = tasks.get_task(name=task_name(op.metadata.name, 0)).last_attempt_result
    assert result.exit_code == 143 and result.status.code == 4


def test_cancel_execution(jobs, executions, tasks, job_id):
    job = create(jobs, job_id, make_job("local/sleep:1", task_count=2, parallelism=1))
    run_op = jobs.run_job(name=job.name)
    wait_running(tasks, task_name(run_op.metadata.name, 0))
    cancelled = executions.cancel_execution(name=run_op.metadata.name).result(timeout=30)
    assert cancelled.cancelled_count == 2
    execution = run_op.result(timeout=30)  # a cancelled execution's LRO has no error
    assert execution.cancelled_count == 2 and execution.succeeded_count + execution.failed_count == 0
    assert execution.conditions[-1].execution_reason == run_v2.Condition.ExecutionReason.CANCELLED


def test_run_overrides(jobs, emulator, bucket, job_id):
    spec = make_job("local/exit:latest", env={"OUT": "/checkpoints", "KEEP": "1"}, bucket=bucket.name,
                    args=["--old"])
    job = create(jobs, job_id, spec)
    overrides = {"container_overrides": [{"args": ["--new"], "env": [{"name": "EXTRA", "value": "2"}]}],
                 "task_count": 2, "timeout": {"seconds": 120}}
    op = jobs.run_job(request=run_v2.RunJobRequest(name=job.name, overrides=overrides))
    execution = op.result(timeout=30)
    assert execution.task_count == 2 and execution.template.timeout.total_seconds() == 120
    env = {e.name: e.value for e in execution.template.containers[0].env}
    assert env == {"OUT": "/checkpoints", "KEEP": "1", "EXTRA": "2"}
    record = json.loads((emulator.bucket_dir(bucket.name) / "task-1/attempt-0.json").read_text())
    assert record["argv"] == ["--new"]
    op = jobs.run_job(request=run_v2.RunJobRequest(
        name=job.name, overrides={"container_overrides": [{"clear_args": True}]}))
    op.result(timeout=30)
    record = json.loads((emulator.bucket_dir(bucket.name) / "task-0/attempt-0.json").read_text())
    assert record["argv"] == ["default-cmd"]


def test_unknown_image_fails_the_task_without_retries(jobs, tasks, job_id):
    job = create(jobs, job_id, make_job("gcr.io/nowhere/unknown:1", max_retries=3))
    op = jobs.run_job(name=job.name)
    with pytest.raises(gexc.FailedPrecondition, match="not in the emulator's image table"):
        op.result(timeout=30)
    assert tasks.get_task(name=task_name(op.metadata.name, 0)).retried == 0


def test_list_and_operations(jobs, executions, job_id):
    job = create(jobs, job_id, make_job("local/exit:latest"))
    names = [jobs.run_job(name=job.name).metadata.name for _ in range(3)]
    page = executions.list_executions(request=run_v2.ListExecutionsRequest(parent=job.name, page_size=2))
    assert [e.name for e in page] == names[::-1]  # pager follows next_page_token; newest first
    assert [j.name for j in jobs.list_jobs(parent=PARENT)][0] == job.name
    all_ops = list(jobs.list_operations(request={"name": PARENT}).operations)
    run_op = next(o for o in all_ops if o.metadata.type_url.endswith("Execution"))
    waited = jobs.wait_operation(request={"name": run_op.name, "timeout": {"seconds": 20}})
    assert waited.done and waited.response.type_url.endswith("google.cloud.run.v2.Execution")
    assert jobs.get_operation(request={"name": run_op.name}).done
    jobs.delete_operation(request={"name": run_op.name})
    with pytest.raises(gexc.NotFound):
        jobs.get_operation(request={"name": run_op.name})


def test_update_and_delete_job(jobs, job_id):
    job = create(jobs, job_id, make_job("local/exit:latest"))
    job.template.task_count = 2
    updated = jobs.update_job(job=job).result(timeout=10)
    assert updated.generation == 2 and updated.template.task_count == 2 and updated.etag != job.etag
    with pytest.raises(gexc.BadRequest, match="etag"):
        jobs.delete_job(request=run_v2.DeleteJobRequest(name=job.name, etag=job.etag))
    deleted = jobs.delete_job(name=job.name).result(timeout=10)
    assert deleted.name == job.name and deleted.delete_time
    with pytest.raises(gexc.NotFound):
        jobs.get_job(name=job.name)


def test_delete_execution_and_cross_job_listing(jobs, executions, tasks, job_id):
    job = create(jobs, job_id, make_job("local/sleep:1", env={"SLEEP": "30"}))
    running = jobs.run_job(name=job.name)
    with pytest.raises(gexc.BadRequest, match="still running") as err:
        executions.delete_execution(name=running.metadata.name)
    assert google_status(err) == "FAILED_PRECONDITION"
    executions.cancel_execution(name=running.metadata.name).result(timeout=30)
    deleted = executions.delete_execution(name=running.metadata.name).result(timeout=10)
    assert deleted.name == running.metadata.name
    with pytest.raises(gexc.NotFound):
        executions.get_execution(name=running.metadata.name)
    finished = jobs.run_job(request=run_v2.RunJobRequest(
        name=job.name, overrides={"container_overrides": [{"env": [{"name": "SLEEP", "value": "0"}]}]}))
    finished.result(timeout=30)
    everywhere = [e.name for e in executions.list_executions(parent=f"{PARENT}/jobs/-")]
    assert finished.metadata.name in everywhere and running.metadata.name not in everywhere
    first_page = jobs.list_jobs(request=run_v2.ListJobsRequest(parent=PARENT, page_size=1))
    assert len(first_page.jobs) == 1 and first_page.next_page_token
