"""Black-box tests: the real run_v2 REST clients against the emulator subprocess."""

from __future__ import annotations

import datetime as dt
import json
import time
import urllib.error
import urllib.request

import pytest
from google.api import launch_stage_pb2
from google.api_core import exceptions as gexc
from google.cloud import run_v2

from cloud_run_emulator.models import PREEMPTION_MESSAGE

from .conftest import PARENT, make_job, task_name

State = run_v2.Condition.State


def create(jobs, job_id, job) -> run_v2.Job:
    return jobs.create_job(parent=PARENT, job=job, job_id=job_id).result(timeout=10)


def wait_running(tasks, name, timeout=10.0) -> run_v2.Task:
    """Wait until the task's first attempt has printed 'started' (its SIGTERM handler is set)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        task = tasks.get_task(name=name)
        if task.start_time and task.retried == 0 and b"started" in _read(task.log_uri):
            return task
        time.sleep(0.05)
    raise AssertionError(f"{name} never started")


def _read(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url) as response:
            return response.read()
    except urllib.error.HTTPError:
        return b""


def poll_execution(executions, name: str, timeout: float = 30.0) -> run_v2.Execution:
    """Poll ``get_execution`` until the execution has a completion time."""
    deadline = time.monotonic() + timeout
    while not (execution := executions.get_execution(name=name)).completion_time:
        assert time.monotonic() < deadline, f"{name} did not finish"
        time.sleep(0.1)
    return execution


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


def _with_limits(job: run_v2.Job, limits: dict) -> run_v2.Job:
    job.template.template.containers[0].resources.limits.update(limits)
    return job


def google_status(excinfo) -> str:
    """The ``error.status`` of the JSON error body (the REST client maps by HTTP code only)."""
    return excinfo.value.response.json()["error"]["status"]


def test_errors_map_to_google_exceptions(jobs, executions, job_id, bucket):
    create(jobs, job_id, make_job("local/exit:latest"))
    with pytest.raises(gexc.Conflict, match="already exists") as err:
        create(jobs, job_id, make_job("local/exit:latest"))
    assert google_status(err) == "ALREADY_EXISTS"
    with pytest.raises(gexc.NotFound):
        jobs.get_job(name=f"{PARENT}/jobs/missing")
    with pytest.raises(gexc.NotFound):
        executions.get_execution(name=f"{PARENT}/jobs/{job_id}/executions/{job_id}-zzzzz")
    with pytest.raises(gexc.NotFound):
        jobs.run_job(name=f"{PARENT}/jobs/missing")
    with pytest.raises(gexc.NotFound):
        jobs.get_operation(request={"name": f"{PARENT}/operations/missing"})
    invalid = [
        ("bad-retries", make_job("local/exit:latest", max_retries=11), "max_retries"),
        ("bad-bucket", make_job("local/exit:latest", bucket="no-such-bucket"), r"volumes\[0\].gcs.bucket"),
        ("long-gpu", make_job("local/exit:latest", gpu=True, timeout_s=7200), "launch_stage"),
        ("Bad_Name", make_job("local/exit:latest"), "job_id"),
        ("two-gpus", _with_limits(make_job("local/exit:latest", gpu=True), {"nvidia.com/gpu": "2"}),
         r"resources.limits: 'nvidia.com/gpu' must be"),
        ("l4-2-cpu", _with_limits(make_job("local/exit:latest", gpu=True), {"cpu": "2"}), "resources.limits.cpu"),
        ("too-many-tasks", make_job("local/exit:latest", task_count=10_001), "task_count"),
    ]
    for bad_id, spec, field in invalid:
        with pytest.raises(gexc.BadRequest, match=field) as err:
            create(jobs, bad_id, spec)
        assert google_status(err) == "INVALID_ARGUMENT"
    beta = create(jobs, "long-gpu", make_job("local/exit:latest", gpu=True, timeout_s=7200, launch_stage=3))
    assert beta.launch_stage == 3
    # the rule holds for a RunJob override too: a GA GPU job's execution may not run over 1 h
    ga = create(jobs, "ga-gpu", make_job("local/exit:latest", gpu=True, timeout_s=3600))
    long_run = run_v2.RunJobRequest.Overrides(timeout={"seconds": 7200})
    with pytest.raises(gexc.BadRequest, match="overrides: A GPU task timeout over 1 hour is a Preview feature") as err:
        jobs.run_job(request=run_v2.RunJobRequest(name=ga.name, overrides=long_run))
    assert google_status(err) == "INVALID_ARGUMENT"
    assert not list(executions.list_executions(parent=ga.name))  # nothing started
    with pytest.raises(gexc.BadRequest, match="etag") as err:
        jobs.run_job(request=run_v2.RunJobRequest(name=f"{PARENT}/jobs/{job_id}", etag='"nope"'))
    assert google_status(err) == "FAILED_PRECONDITION"


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


def test_injected_api_faults(jobs, emulator, job_id):
    from cloud_run_emulator.process import post_json

    create(jobs, job_id, make_job("local/exit:latest"))
    post_json(emulator.endpoint + "/_emulator/faults", {"failNext": 1, "codes": [429]})
    try:
        with pytest.raises(gexc.TooManyRequests):
            jobs.get_job(name=f"{PARENT}/jobs/{job_id}", retry=None)
        assert jobs.get_job(name=f"{PARENT}/jobs/{job_id}").name.endswith(job_id)
    finally:
        post_json(emulator.endpoint + "/_emulator/faults", {})


@pytest.mark.parametrize(("code", "error"), [(500, gexc.InternalServerError), (504, gexc.GatewayTimeout)])
def test_lost_answer_fault_applies_the_request_then_fails_it(jobs, emulator, job_id, code, error):
    from cloud_run_emulator.process import post_json

    post_json(emulator.endpoint + "/_emulator/faults", {"loseAnswerNext": 1, "loseAnswerCode": code})
    try:
        with pytest.raises(error, match="applied but its answer was lost"):
            jobs.create_job(parent=PARENT, job=make_job("local/exit:latest"), job_id=job_id, retry=None)
        assert jobs.get_job(name=f"{PARENT}/jobs/{job_id}").name.endswith(job_id)  # it was applied
        create(jobs, f"{job_id}-b", make_job("local/exit:latest"))  # one request only
    finally:
        post_json(emulator.endpoint + "/_emulator/faults", {})
    for bad in ({"loseAnswerCode": 503}, {"loseAnswerNext": -1}, {"loseAnswerNext": True}):
        answer = post_json(emulator.endpoint + "/_emulator/faults", bad)
        assert answer["error"]["status"] == "INVALID_ARGUMENT" and "loseAnswer" in answer["error"]["message"]


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


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (f"/v2/{PARENT}/jobs?jobId=bad-bytes", b"\xff\xfe{"),  # not UTF-8
        (f"/v2/{PARENT}/jobs?jobId=bad-json", b"{\"template\": "),  # torn JSON
        ("/_emulator/faults", b"\xff"),  # the admin API too
    ],
)
def test_undecodable_bodies_are_invalid_argument_not_500(emulator, path: str, body: bytes) -> None:
    request = urllib.request.Request(emulator.endpoint + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request)
    assert err.value.code == 400
    assert json.loads(err.value.read())["error"]["status"] == "INVALID_ARGUMENT"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"launchStage": 999}, "job.launch_stage: invalid value 999"),
        ({"template": {"template": {"executionEnvironment": 77, "containers": [{"image": "local/exit:latest"}]}}},
         "job.template.template.execution_environment: invalid value 77"),
    ],
)
def test_enum_numbers_outside_the_enum_are_invalid_argument(emulator, job_id, body: dict, field: str) -> None:
    """JSON may carry any integer for a proto3 enum; Cloud Run answers an undefined one with 400."""
    request = urllib.request.Request(f"{emulator.endpoint}/v2/{PARENT}/jobs?jobId={job_id}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request)
    error = json.loads(err.value.read())["error"]
    assert err.value.code == 400 and error["status"] == "INVALID_ARGUMENT" and field in error["message"]
