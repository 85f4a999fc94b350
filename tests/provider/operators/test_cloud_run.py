"""Deploy and execute operators through ``dag.test()`` against the local Cloud Run emulator: what
an execution's end makes of the task (success, failure, non-retryable exit codes, preemptions and
their re-runs, cancellation, task timeouts), the summary, progress, lost work and container logs
it reports, and the deploy operator's idempotence. A retried try attaching to its execution and
the time limits are in ``test_attach_and_timeouts.py``; argument checks at parse time in
``test_operator_arguments.py``."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from airflow_gpu_resilience.compat import AIRFLOW_V_3_0_PLUS
from google.api import launch_stage_pb2

from airflow.utils.state import TaskInstanceState

from airflow_gpu_resilience.exceptions import CloudRunGpuExecutionError, CloudRunGpuFatalError
from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.operators.cloud_run import RUN_KEY_ENV, CloudRunGpuExecuteJobOperator
from tests.provider.conftest import BUCKET, PROJECT, REGION, STUB_IMAGE, bucket_dir, wait_until_running
from tests.provider.operators.conftest import deploy, executions
from tests.provider.operators.dag_factory import CAPTURED

pytestmark = pytest.mark.usefixtures("airflow_db")


@pytest.mark.parametrize("deferrable", [True, False])
def test_success(gcp_conn, job_name, run_execute, deferrable):
    deploy(job_name, ["ok"], task_count=2)
    ti = run_execute(deferrable=deferrable)
    assert ti.state == TaskInstanceState.SUCCESS
    [summary] = CAPTURED["summaries"]
    assert json.loads(json.dumps(summary)) == summary
    assert summary["outcome"] == "SUCCEEDED" and summary["reruns"] == 0 and summary["task_count"] == 2
    assert summary["job_name"] == job_name and len(summary["executions"]) == 1
    assert [t["index"] for t in summary["tasks"]] == [0, 1]
    assert all(t["outcomes"] == ["SUCCEEDED"] and t["exit_codes"] == [0] for t in summary["tasks"])
    assert summary["preemptions"] == []
    [execution] = executions(job_name)
    env = {e.name: e.value for e in execution.template.containers[0].env}
    assert env[RUN_KEY_ENV] and env["CHECKPOINT_DIR"] == "/checkpoints"


def test_exit_1_fails_after_airflow_retries_with_exit_code_in_message(gcp_conn, job_name, run_execute):
    deploy(job_name, ["exit", "1"], max_retries=1)
    ti = run_execute(retries=1)
    assert ti.state == TaskInstanceState.FAILED
    assert ti.try_number == 2
    error = CAPTURED["errors"][-1]
    assert isinstance(error, CloudRunGpuExecutionError) and not isinstance(error, CloudRunGpuFatalError)
    assert error.exit_code == 1 and error.outcome == "FAILED"
    assert "exit code 1" in str(error) and "attempt 2" in str(error) and "Logs: http" in str(error)
    assert len(executions(job_name)) == 2  # one per Airflow try
    # the failed try's goodput account: its one execution, both attempts (the first without times of
    # its own: placed before the second, billed)
    [account] = error.goodput["tasks"]
    assert (len(account["attempts"]), account["inferred_attempts"], account["productive"]) == (2, 1, 0.0)
    assert account["unknown_attempts"] == 0
    assert error.goodput["headline"] in str(error)


def test_sysexits_code_fails_without_retry(gcp_conn, job_name, run_execute):
    deploy(job_name, ["exit", "78"], max_retries=3)
    ti = run_execute(retries=2)
    assert ti.state == TaskInstanceState.FAILED
    assert ti.try_number == 1
    error = CAPTURED["errors"][-1]
    assert isinstance(error, CloudRunGpuFatalError) and error.exit_code == 78
    assert "FATAL" in str(error) and "non-retryable exit code" in str(error)
    assert len(executions(job_name)) == 1


@pytest.mark.parametrize("deferrable", [True, False])
def test_always_preempted_exhausts_the_budget(gcp_conn, job_name, run_execute, deferrable):
    deploy(job_name, ["exit", "143"], max_retries=0)
    ti = run_execute(retries=1, max_preemption_reruns=2, deferrable=deferrable)
    assert ti.state == TaskInstanceState.FAILED and ti.try_number == 1
    error = CAPTURED["errors"][-1]
    assert isinstance(error, CloudRunGpuFatalError) and error.outcome == "PREEMPTED"
    assert "preemption budget exhausted (2 re-runs used)" in str(error)
    assert len(executions(job_name)) == 3
    # what the exhausted budget cost: the three executions' attempts, also when deferred
    [account] = error.goodput["tasks"]
    assert len(account["attempts"]) == 3 and account["gpu_seconds"] == pytest.approx(account["attempt_seconds"])
    assert "over 3 attempt(s)" in str(error)


def test_preempted_once_then_resumes_in_a_second_execution(gcp_conn, job_name, emulator, run_execute):
    deploy(job_name, ["preempt-once"], max_retries=0)
    ti = run_execute(max_preemption_reruns=2)
    assert ti.state == TaskInstanceState.SUCCESS
    [summary] = CAPTURED["summaries"]
    assert summary["reruns"] == 1 and len(summary["executions"]) == 2
    assert [e["action"] for e in summary["executions"]] == ["RERUN", "SUCCEED"]
    assert summary["tasks"] == [{"index": 0, "attempts": 2, "exit_codes": [143, 0], "outcomes": ["PREEMPTED", "SUCCEEDED"]}]
    [preemption] = summary["preemptions"]
    assert (preemption["task_index"], preemption["attempt"], preemption["exit_code"]) == (0, 0, 143)
    assert preemption["execution"] == summary["executions"][0]["name"]
    assert (bucket_dir(emulator) / f"{job_name}-task0.marker").exists()


def test_injected_maintenance_preemption_is_retried_and_reported(gcp_conn, job_name, emulator, run_execute):
    """A real SIGTERM preemption (emulator admin endpoint) while the operator waits in the trigger."""
    deploy(job_name, ["sleep-first", "60", "3"], max_retries=1)
    hook = CloudRunGpuHook()
    injected = []

    def preempt_when_running():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not injected:
            running = hook.list_executions(job_name=job_name, region=REGION, project_id=PROJECT)
            if running:
                wait_until_running(hook, running[0].name)
                injected.append(emulator.preempt(running[0].name, task_index=0, grace_seconds=0.5))
            time.sleep(0.05)

    thread = threading.Thread(target=preempt_when_running, daemon=True)
    thread.start()
    ti = run_execute(max_preemption_reruns=1, poll_interval=0.05)
    thread.join(timeout=5)
    assert injected and ti.state == TaskInstanceState.SUCCESS
    [summary] = CAPTURED["summaries"]
    assert summary["reruns"] == 0 and len(summary["executions"]) == 1
    assert summary["tasks"] == [{"index": 0, "attempts": 2, "exit_codes": [-15, 0], "outcomes": ["PREEMPTED", "SUCCEEDED"]}]
    [preemption] = summary["preemptions"]
    assert (preemption["attempt"], preemption["term_signal"], preemption["exit_code"]) == (0, 15, None)
    assert "hardware maintenance" in preemption["message"]


def test_every_task_preempted_once_resumes_together(gcp_conn, job_name, run_execute):
    """Two tasks, each preempted on the first execution; user overrides are kept on the re-run."""
    deploy(job_name, ["exit", "1"], max_retries=0, task_count=2)
    ti = run_execute(overrides={"container_overrides": [{"args": ["preempt-once"]}]})
    assert ti.state == TaskInstanceState.SUCCESS
    [summary] = CAPTURED["summaries"]
    # The first 143 fails the execution; a sibling still running is stopped by SIGTERM (-15),
    # possibly before it wrote its marker, which costs it one more re-run.
    assert summary["reruns"] in (1, 2) and summary["task_count"] == 2
    for task in summary["tasks"]:
        # A re-run runs every task again; a task that had finished exits 0 at once. A sibling
        # the platform cancelled when the first 143 failed the execution (Cloud Run cancels the
        # tasks still running) is CANCELLED, not PREEMPTED: its attempt's status says so.
        assert task["outcomes"][0] in ("PREEMPTED", "CANCELLED") and task["outcomes"][-1] == "SUCCEEDED", summary["tasks"]
        assert task["exit_codes"][0] in (143, -15)
    assert "PREEMPTED" in [task["outcomes"][0] for task in summary["tasks"]], summary["tasks"]
    # a sibling cancelled before it wrote its marker is preempted in the re-run: every task
    # preempted in any execution is in the preemptions, and no other
    preempted = [task["index"] for task in summary["tasks"] if "PREEMPTED" in task["outcomes"]]
    assert sorted({p["task_index"] for p in summary["preemptions"]}) == preempted
    for execution in executions(job_name):
        assert list(execution.template.containers[0].args) == ["preempt-once"]


def test_cancelled_execution_fails_without_retry(gcp_conn, job_name, run_execute):
    deploy(job_name, ["sleep", "60"], max_retries=3)
    hook = CloudRunGpuHook()
    cancelled = []

    def cancel_when_running():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not cancelled:
            running = hook.list_executions(job_name=job_name, region=REGION, project_id=PROJECT)
            if running:
                wait_until_running(hook, running[0].name)
                cancelled.append(hook.cancel_execution(execution=running[0].name))
            time.sleep(0.05)

    thread = threading.Thread(target=cancel_when_running, daemon=True)
    thread.start()
    ti = run_execute(retries=2)
    thread.join(timeout=5)
    assert cancelled and ti.state == TaskInstanceState.FAILED and ti.try_number == 1
    error = CAPTURED["errors"][-1]
    assert isinstance(error, CloudRunGpuFatalError) and error.outcome == "CANCELLED"


def test_task_timeout_is_rerun_on_the_same_budget(gcp_conn, job_name, run_execute):
    deploy(job_name, ["sleep", "60"], max_retries=0, task_timeout=1)
    ti = run_execute(max_preemption_reruns=1)
    assert ti.state == TaskInstanceState.FAILED and ti.try_number == 1
    error = CAPTURED["errors"][-1]
    assert isinstance(error, CloudRunGpuFatalError) and error.outcome == "TIMED_OUT"
    assert "timed out; preemption budget exhausted (1 re-runs used)" in str(error)
    assert "exceeded its timeout" in str(error)
    assert len(executions(job_name)) == 2


def test_deploy_operator_is_idempotent_and_pushes_generation(gcp_conn, job_name, run_dag):
    dr = run_dag("deploy_dag", dag_id=f"deploy_{job_name.replace('-', '_')}", job_name=job_name,
                 image=STUB_IMAGE, bucket=BUCKET)
    assert dr.get_task_instance("deploy_again").state == TaskInstanceState.SUCCESS
    one, two = CAPTURED["summaries"]
    assert one["action"] == "created" and two["action"] == "unchanged"
    assert one["generation"] == two["generation"] and one["job_name"] == job_name
    job = CloudRunGpuHook().get_job(job_name=job_name, region=REGION, project_id=PROJECT)
    assert job.template.template.max_retries == 2 and job.launch_stage == launch_stage_pb2.LaunchStage.BETA


@pytest.mark.parametrize("deferrable", [True, False])
def test_progress_eta_and_lost_work_from_the_worker_files(
    gcp_conn, gcs_emulator_host, job_name, run_execute, monkeypatch, capfd, deferrable
):
    monkeypatch.setattr(CloudRunGpuExecuteJobOperator, "progress_log_interval", 0.0)
    deploy(job_name, ["progress", "1.5"], max_retries=0)
    ti = run_execute(checkpoint_bucket=BUCKET, deferrable=deferrable)
    assert ti.state == TaskInstanceState.SUCCESS
    [summary] = CAPTURED["summaries"]
    second = summary["executions"][1]["name"].rsplit("/", 1)[-1]  # the worker writes the short id
    assert summary["lost_work"] == [
        {"task_index": 0, "execution": second, "attempt": 0, "resumed_from_step": 20, "lost_steps": 10}
    ]
    assert summary["lost_steps_total"] == 10
    assert summary["progress"]["0"]["step"] == 100 and summary["progress"]["0"]["eta_seconds"] == 0.0
    out = capfd.readouterr().out
    assert "Lost work: task 0 lost 10 steps" in out
    if not deferrable:  # while waiting in the worker; the deferred operator logs at resume
        assert "Progress task 0: step 30/100 (30%), 10 steps/s, ETA 7 s, loss 0.5 [running]" in out


def test_unreadable_progress_files_never_fail_the_task(gcp_conn, gcs_emulator_host, job_name, run_execute):
    deploy(job_name, ["ok"])
    ti = run_execute(checkpoint_bucket="no-such-bucket", deferrable=False)
    assert ti.state == TaskInstanceState.SUCCESS
    [summary] = CAPTURED["summaries"]
    assert summary["lost_work"] == [] and summary["progress"] == {} and summary["lost_steps_total"] == 0


def _logging_requests(emulator) -> int:
    import urllib.request

    with urllib.request.urlopen(emulator.endpoint + "/_emulator/health", timeout=10) as answer:
        return json.loads(answer.read())["loggingRequests"]


@pytest.mark.parametrize("log_container_output", [True, False])
def test_container_logs_in_the_task_log_polling_in_the_worker_and_the_goodput_account(
        gcp_conn, job_name, emulator, run_execute, capfd, log_container_output):
    """Sync mode: each attempt's lines once while polling and at the end; off: no Logging call.
    Both: the summary's goodput account has both attempts (stub: no events file). About 10 s each."""
    deploy(job_name, ["preempt-once"], max_retries=1)
    before = _logging_requests(emulator)
    ti = run_execute(deferrable=False, log_container_output=log_container_output)
    assert ti.state == TaskInstanceState.SUCCESS
    [summary] = CAPTURED["summaries"]
    [account] = summary["goodput"]["tasks"]
    # attempt 0 has no times (the stub writes no events file): placed before attempt 1, billed
    assert [(a["attempt"], a["times_from"]) for a in account["attempts"]] == [(0, "inferred"), (1, "platform")]
    assert account["unknown_attempts"] == 0
    out = capfd.readouterr()
    # the task log as dag.test() prints it: Airflow 3 "... Container log: <line> [airflow.task.operators...]",
    # Airflow 2.11 "[time] {cloud_run.py:N} INFO - Container log: <line>", every line twice (two handlers)
    lines = ["Container log: " + m for m in re.findall(r"Container log: (.*?)(?: \[airflow\.task|$)", out.out + out.err, re.M)]
    if not AIRFLOW_V_3_0_PLUS:
        lines = lines[::2] if lines[::2] == lines[1::2] else lines
    if not log_container_output:
        assert lines == [] and _logging_requests(emulator) == before
        return
    assert _logging_requests(emulator) > before
    assert [line for line in lines if "stub preempt-once attempt" in line] == [
        "Container log: task 0 attempt 0 DEFAULT: stub preempt-once attempt 0",
        "Container log: task 0 attempt 1 DEFAULT: stub preempt-once attempt 1",
    ]
    assert any("attempt 0 WARNING: [platform]" in line for line in lines), lines
