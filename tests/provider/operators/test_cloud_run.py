"""Deploy and execute operators through ``dag.test()`` against the local Cloud Run emulator."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import re
import threading
import time
import warnings

from pathlib import Path

import pytest

from airflow_gpu_resilience.compat import AIRFLOW_V_3_0_PLUS
from google.api import launch_stage_pb2

from airflow.utils.state import TaskInstanceState

from airflow_gpu_resilience.exceptions import (
    CloudRunGpuExecutionError,
    CloudRunGpuFatalError,
    CloudRunGpuTimeoutError,
)
from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.overrides import START_ID_ENV, execution_env, with_env_overrides
from airflow_gpu_resilience.job_spec import GpuJobSpec
from airflow_gpu_resilience.outcome import ExecutionState, execution_state
from airflow_gpu_resilience.operators.cloud_run import (
    RERUN_ENV,
    RUN_KEY_ENV,
    CloudRunGpuDeployJobOperator,
    CloudRunGpuExecuteJobOperator,
    RunState,
)
from tests.airflow_compat import allow_execute_in_this_thread
from tests.provider.conftest import BUCKET, PROJECT, REGION, STUB_IMAGE, bucket_dir, wait_until_running
from tests.provider.operators import dag_factory
from tests.provider.operators.dag_factory import CAPTURED, write_dag_file

pytestmark = pytest.mark.usefixtures("airflow_db")


@pytest.fixture(autouse=True)
def _clear_captured():
    CAPTURED["summaries"].clear()
    CAPTURED["errors"].clear()


@pytest.fixture
def run_dag():
    """Run a factory DAG with ``dag.test()``; its dags-folder twin is removed afterwards."""
    from airflow.configuration import conf

    written = []

    def run(factory: str, **kwargs):
        written.append(write_dag_file(Path(conf.get("core", "dags_folder")), factory, kwargs))
        return getattr(dag_factory, factory)(**kwargs).test()

    yield run
    for path in written:
        path.unlink(missing_ok=True)


def deploy(job_name: str, args: list[str], max_retries: int = 0, **kw) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = GpuJobSpec(name=job_name, image=STUB_IMAGE, args=args, max_retries=max_retries,
                          checkpoint_bucket=BUCKET, **kw)
    CloudRunGpuHook().create_job(job_name=job_name, job=spec, region=REGION, project_id=PROJECT)


@pytest.fixture
def run_execute(run_dag, job_name):
    """Run the execute DAG for ``job_name``; return its ``execute`` task instance."""

    def run(**kwargs):
        dr = run_dag("execute_dag", dag_id=f"exec_{job_name.replace('-', '_')}", job_name=job_name, **kwargs)
        return dr.get_task_instance("execute")

    return run


def executions(job_name: str) -> list:
    return CloudRunGpuHook().list_executions(job_name=job_name, region=REGION, project_id=PROJECT)


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


def own_state(op, ti) -> RunState:
    return RunState(project_id=PROJECT, run_key=op.run_key({"ti": ti}), budget=3)


def test_retry_attaches_to_the_running_execution(gcp_conn, job_name):
    """A second try of the same task instance finds its execution by the run-key env var."""
    deploy(job_name, ["sleep", "60"], max_retries=0)
    hook = CloudRunGpuHook()
    op = CloudRunGpuExecuteJobOperator(task_id="execute", job_name=job_name, region=REGION)
    ti = _TI()
    state = own_state(op, ti)
    started = hook.start_execution(job_name=job_name, region=REGION, project_id=PROJECT,
                                   overrides=with_env_overrides(None, {RUN_KEY_ENV: state.run_key}))
    try:
        assert op.run_manager({"ti": ti}).attach_or_start(state).execution == started
        assert ti.xcom["execution_name"] == started and len(executions(job_name)) == 1
    finally:
        hook.cancel_execution(execution=started, wait=True)


@pytest.mark.parametrize(("args", "adopted"), [(["ok"], True), (["exit", "1"], False)])
def test_a_finished_execution_is_adopted_only_if_no_try_acted_on_it(gcp_conn, job_name, args, adopted):
    """Succeeded (or only preempted): nobody has acted on it. Failed: the earlier try raised."""
    deploy(job_name, args, max_retries=0)
    hook = CloudRunGpuHook()
    op = CloudRunGpuExecuteJobOperator(task_id="execute", job_name=job_name, region=REGION)
    ti = _TI()
    state = own_state(op, ti)
    finished = hook.start_execution(job_name=job_name, region=REGION, project_id=PROJECT,
                                    overrides=with_env_overrides(None, {RUN_KEY_ENV: state.run_key}))
    hook.wait_for_execution(finished, poll_interval=0.1, timeout=30)
    step = op.run_manager({"ti": ti}).attach_or_start(state)
    if adopted:
        result = step.summary
        assert result["outcome"] == "SUCCEEDED" and result["executions"][0]["name"] == finished
        assert len(executions(job_name)) == 1
    else:
        result = step.execution
        assert result != finished and len(executions(job_name)) == 2
        hook.wait_for_execution(result, poll_interval=0.1, timeout=30)


def test_deploy_operator_is_idempotent_and_pushes_generation(gcp_conn, job_name, run_dag):
    dr = run_dag("deploy_dag", dag_id=f"deploy_{job_name.replace('-', '_')}", job_name=job_name,
                 image=STUB_IMAGE, bucket=BUCKET)
    assert dr.get_task_instance("deploy_again").state == TaskInstanceState.SUCCESS
    one, two = CAPTURED["summaries"]
    assert one["action"] == "created" and two["action"] == "unchanged"
    assert one["generation"] == two["generation"] and one["job_name"] == job_name
    job = CloudRunGpuHook().get_job(job_name=job_name, region=REGION, project_id=PROJECT)
    assert job.template.template.max_retries == 2 and job.launch_stage == launch_stage_pb2.LaunchStage.BETA


def test_deploy_operator_validates_at_parse_time_when_not_templated():
    with pytest.raises(ValueError, match="gpu_type='nvidia-h100' is not supported"):
        CloudRunGpuDeployJobOperator(task_id="d", job_name="j", image="img", gpu_type="nvidia-h100",
                                     checkpoint_bucket=BUCKET)


def test_deploy_operator_validates_templated_values_before_any_api_call():
    op = CloudRunGpuDeployJobOperator(task_id="d", job_name="j", image="img", max_retries="{{ x }}",
                                      checkpoint_bucket=BUCKET)
    op.max_retries = "12"  # as rendered
    with pytest.raises(ValueError, match="max_retries=12 is out of range"):
        op.execute({})


def test_deploy_operator_takes_every_spec_field_with_the_specs_default():
    """The deploy operator's spec arguments are GpuJobSpec's fields (``name`` is ``job_name``)."""
    from airflow.providers.common.compat.sdk import DAG

    parameters = inspect.signature(CloudRunGpuDeployJobOperator.__init__).parameters
    for spec_field in dataclasses.fields(GpuJobSpec):
        if spec_field.name == "name":
            continue
        if spec_field.default_factory is not dataclasses.MISSING:
            default = spec_field.default_factory()
        else:
            default = inspect.Parameter.empty if spec_field.default is dataclasses.MISSING else spec_field.default
        assert parameters[spec_field.name].default == default, spec_field.name
        assert spec_field.name in CloudRunGpuDeployJobOperator.template_fields
    with DAG(dag_id="defaults", schedule=None, default_args={"memory": "32Gi", "max_retries": 5}):
        op = CloudRunGpuDeployJobOperator(task_id="d", job_name="j", image="img", checkpoint_bucket=BUCKET)
    spec = op.build_spec()
    assert (spec.memory, spec.max_retries, spec.cpu, spec.env) == ("32Gi", 5, "4", {})


def test_execute_operator_rejects_negative_budget():
    with pytest.raises(ValueError, match="max_preemption_reruns=-1"):
        CloudRunGpuExecuteJobOperator(task_id="e", job_name="j", max_preemption_reruns=-1)


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


@pytest.mark.parametrize("deferrable", [True, False])
def test_wait_timeout_is_retryable_and_the_retry_attaches(gcp_conn, job_name, run_execute, deferrable):
    deploy(job_name, ["sleep", "60"], max_retries=0)
    hook = CloudRunGpuHook()
    try:
        ti = run_execute(retries=1, wait_timeout=0.5, deferrable=deferrable)
        assert ti.state == TaskInstanceState.FAILED and ti.try_number == 2
        assert "still running after 0.5 s" in str(CAPTURED["errors"][-1])
        [execution] = hook.list_executions(job_name=job_name, region=REGION, project_id=PROJECT)
    finally:
        for execution in hook.list_executions(job_name=job_name, region=REGION, project_id=PROJECT):
            hook.cancel_execution(execution=execution.name, wait=True)


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


def envs(job_name: str, name: str) -> list[str]:
    """The value of env var ``name`` on each execution of the job, newest first."""
    return [execution_env(e).get(name) for e in executions(job_name)]


@pytest.mark.parametrize("deferrable", [True, False])
def test_preemption_budget_survives_a_retry_that_attaches_to_a_rerun(gcp_conn, job_name, run_execute, deferrable):
    """Try 1 re-runs once, then times out waiting; try 2 attaches to the re-run and finds the budget used."""
    deploy(job_name, ["preempt-then-sleep", "3"], max_retries=0)
    ti = run_execute(retries=1, wait_timeout=1.5, max_preemption_reruns=1, deferrable=deferrable)
    assert ti.state == TaskInstanceState.FAILED and ti.try_number == 2
    error = CAPTURED["errors"][-1]
    assert isinstance(error, CloudRunGpuFatalError) and error.outcome == "PREEMPTED"
    assert "preemption budget exhausted (1 re-runs used)" in str(error)
    assert envs(job_name, RERUN_ENV) == ["1", "0"]
    assert len(set(envs(job_name, RUN_KEY_ENV))) == 1


@pytest.mark.serial  # a wall-clock bound: failed within 30 s of the start
@pytest.mark.parametrize("deferrable", [True, False])
def test_overall_timeout_spans_reruns_and_cancels_the_execution(gcp_conn, job_name, run_execute, deferrable):
    deploy(job_name, ["preempt-then-sleep", "60"], max_retries=0)
    started = time.monotonic()
    ti = run_execute(timeout=3.0, deferrable=deferrable)
    assert time.monotonic() - started < 30
    assert ti.state == TaskInstanceState.FAILED
    error = CAPTURED["errors"][-1]
    assert isinstance(error, CloudRunGpuTimeoutError) and "overall timeout passed" in str(error)
    assert "1 earlier execution(s)" in str(error)
    rerun, first = executions(job_name)
    assert error.execution == rerun.name
    # the account includes the execution being cancelled (its attempt still running: the stub
    # writes no events, so it has no end yet and is counted as unknown)
    [account] = error.goodput["tasks"]
    assert len(account["attempts"]) + account["unknown_attempts"] == 2
    assert error.goodput["headline"] in str(error)
    final = CloudRunGpuHook().wait_for_execution(rerun.name, poll_interval=0.1, timeout=20)
    assert execution_state(final) is ExecutionState.CANCELLED
    assert execution_state(first) is ExecutionState.FAILED


def test_execution_timeout_is_the_overall_timeout_when_deferred(gcp_conn, job_name, run_execute):
    """Airflow does not apply ``execution_timeout`` across deferrals; the operator does."""
    deploy(job_name, ["sleep", "60"], max_retries=0)
    ti = run_execute(execution_timeout_seconds=2)
    assert ti.state == TaskInstanceState.FAILED
    assert isinstance(CAPTURED["errors"][-1], CloudRunGpuTimeoutError)
    [execution] = executions(job_name)
    final = CloudRunGpuHook().wait_for_execution(execution.name, poll_interval=0.1, timeout=20)
    assert execution_state(final) is ExecutionState.CANCELLED


class _TI:
    """The few task-instance attributes ``execute`` reads, and an XCom store."""

    dag_id, run_id, task_id, map_index = "kill_dag", "run-1", "execute", -1

    def __init__(self):
        self.xcom = {}

    def xcom_push(self, key, value):
        self.xcom[key] = value


def test_on_kill_cancels_the_running_execution(gcp_conn, job_name):
    deploy(job_name, ["sleep", "60"], max_retries=3)
    op = CloudRunGpuExecuteJobOperator(task_id="execute", job_name=job_name, region=REGION, deferrable=False,
                                       poll_interval=0.1)
    outcome, ti = {}, _TI()

    def run():
        allow_execute_in_this_thread()
        try:
            op.execute({"ti": ti})
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while "execution_name" not in ti.xcom and time.monotonic() < deadline:
        time.sleep(0.05)
    wait_until_running(CloudRunGpuHook(), ti.xcom["execution_name"])
    op.on_kill()
    thread.join(timeout=30)
    [execution] = executions(job_name)
    assert execution_state(execution) is ExecutionState.CANCELLED
    assert isinstance(outcome["error"], CloudRunGpuFatalError) and outcome["error"].outcome == "CANCELLED"


@pytest.mark.parametrize(("args", "expected"), [(["sleep", "4"], 1), (["preempt-then-sleep", "4"], 2)])
def test_no_duplicate_execution_with_503s_and_a_retry_mid_execution(
    gcp_conn, job_name, run_execute, faults, monkeypatch, args, expected
):
    """A quarter of the API calls fail (503/429) and try 1 gives up waiting while the execution runs."""
    from airflow_gpu_resilience.hooks import cloud_run

    monkeypatch.setattr(cloud_run, "default_retry", functools.partial(cloud_run.default_retry, initial=0.05))
    deploy(job_name, args, max_retries=0)
    faults(errorRate=0.25, codes=[503, 429], seed=7)
    ti = run_execute(retries=4, wait_timeout=1.5, poll_interval=0.1, max_preemption_reruns=0 if expected == 1 else 1)
    faults()
    if expected == 1:
        assert ti.state == TaskInstanceState.SUCCESS, CAPTURED["errors"]
    else:  # the re-run is preempted too: the budget of 1 is used across the tries
        assert "preemption budget exhausted (1 re-runs used)" in str(CAPTURED["errors"][-1])
    assert ti.try_number >= 2  # at least one try gave up waiting, and a later one attached
    assert len(executions(job_name)) == expected
    assert len(set(envs(job_name, START_ID_ENV))) == expected


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


def test_execute_operator_rejects_a_bad_timeout():
    with pytest.raises(ValueError, match="timeout=0 must be a positive"):
        CloudRunGpuExecuteJobOperator(task_id="e", job_name="j", timeout=0)


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"wait_timeout": 0}, "wait_timeout=0"),
    ({"wait_timeout": -3}, "wait_timeout=-3"),
    ({"wait_timeout": "ten minutes"}, "wait_timeout='ten minutes'"),
    ({"wait_timeout": float("nan")}, "wait_timeout=nan"),
    ({"wait_timeout": float("inf")}, "wait_timeout=inf"),
    ({"timeout": float("inf")}, "timeout=inf"),
    ({"timeout": "abc"}, "timeout='abc'"),
    ({"timeout": True}, "timeout=True"),
    ({"poll_interval": 0}, "poll_interval=0"),
    ({"poll_interval": -5}, "poll_interval=-5"),
    ({"poll_interval": float("inf")}, "poll_interval=inf"),
])
def test_execute_operator_rejects_bad_durations_when_the_dag_is_parsed(kwargs, named):
    """One ValueError naming the parameter, from the constructor: no execution can start."""
    with pytest.raises(ValueError, match=re.escape(named) + " must be a positive, finite number of seconds"):
        CloudRunGpuExecuteJobOperator(task_id="e", job_name="j", **kwargs)


def test_durations_given_as_numeric_strings_are_seconds():
    op = CloudRunGpuExecuteJobOperator(task_id="e", job_name="j", wait_timeout="600", timeout="3600")
    assert (op.wait_timeout, op.timeout) == (600.0, 3600.0)


def test_a_templated_poll_interval_is_checked_once_rendered():
    op = CloudRunGpuExecuteJobOperator(task_id="e", job_name="j", poll_interval="{{ params.poll }}")
    op.poll_interval = "0"  # as rendered
    with pytest.raises(ValueError, match="poll_interval='0' must be a positive, finite number of seconds"):
        op.execute({})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gpu_type": "nvidia-h100"}, r"gpu_type='nvidia-h100' is not supported; allowed: \['nvidia-l4', 'nvidia-rtx-pro-6000'\]"),
        ({"max_retries": 11}, r"max_retries=11 is out of range: allowed integers are 0-10"),
        ({"task_timeout": 168 * 3600 + 1}, r"task_timeout=604801 s is out of range: allowed 1-604800 seconds \(168 h\)"),
        ({"memory": "8Gi"}, r"memory='8Gi' is below the nvidia-l4 minimum of 16 GiB"),
        ({"image": ""}, r"image must be a non-empty container image URI"),
        ({"checkpoint_bucket": "Bad_Bucket"}, r"checkpoint_bucket='Bad_Bucket' is not a valid Cloud Storage bucket name"),
        ({"adopt_existing_job": "yes"}, r"adopt_existing_job='yes' must be True or False"),
    ],
)
def test_deploy_operator_rejects_bad_parameters_when_the_dag_is_parsed(kwargs, match):
    """Bad parameters: no operator (and so no API call) is ever built."""
    base = {"task_id": "d", "job_name": "train", "image": "img", "checkpoint_bucket": BUCKET}
    with pytest.raises(ValueError, match=match):
        CloudRunGpuDeployJobOperator(**{**base, **kwargs})


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
