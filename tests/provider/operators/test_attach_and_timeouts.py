"""The execute operator against the local Cloud Run emulator across Airflow tries: a retried try
attaches to its execution (by the run-key env var) or adopts a finished one no try acted on, the
preemption budget survives the retry, no duplicate execution under injected 503s; and its time
limits: the wait timeout, the overall timeout across re-runs, ``execution_timeout`` when deferred,
and ``on_kill``."""

from __future__ import annotations

import functools
import threading
import time

import pytest

from airflow.utils.state import TaskInstanceState

from airflow_gpu_resilience.exceptions import CloudRunGpuFatalError, CloudRunGpuTimeoutError
from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.overrides import START_ID_ENV, execution_env, with_env_overrides
from airflow_gpu_resilience.outcome import ExecutionState, execution_state
from airflow_gpu_resilience.operators.cloud_run import RERUN_ENV, RUN_KEY_ENV, CloudRunGpuExecuteJobOperator, RunState
from tests.airflow_compat import allow_execute_in_this_thread
from tests.provider.conftest import PROJECT, REGION, wait_until_running
from tests.provider.operators.conftest import deploy, executions
from tests.provider.operators.dag_factory import CAPTURED

pytestmark = pytest.mark.usefixtures("airflow_db")


class _TI:
    """The few task-instance attributes ``execute`` reads, and an XCom store."""

    dag_id, run_id, task_id, map_index = "kill_dag", "run-1", "execute", -1

    def __init__(self):
        self.xcom = {}

    def xcom_push(self, key, value):
        self.xcom[key] = value


def own_state(op, ti) -> RunState:
    return RunState(project_id=PROJECT, run_key=op.run_key(ti), budget=3)


def envs(job_name: str, name: str) -> list[str]:
    """The value of env var ``name`` on each execution of the job, newest first."""
    return [execution_env(e).get(name) for e in executions(job_name)]


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
        assert op.run_manager(ti).attach_or_start(state).execution == started
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
    step = op.run_manager(ti).attach_or_start(state)
    if adopted:
        result = step.summary
        assert result["outcome"] == "SUCCEEDED" and result["executions"][0]["name"] == finished
        assert len(executions(job_name)) == 1
    else:
        result = step.execution
        assert result != finished and len(executions(job_name)) == 2
        hook.wait_for_execution(result, poll_interval=0.1, timeout=30)


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


@pytest.mark.parametrize("deferrable", [True, False])
def test_preemption_budget_survives_a_retry_that_attaches_to_a_rerun(gcp_conn, job_name, run_execute, deferrable):
    """Try 1 re-runs once, then times out waiting; a later try attaches to the re-run and finds the
    budget used. (Which later try: a try that attaches with less than its 1.5 s wait left of the
    re-run's 3 s times out too, on a busy machine; the next one attaches again.)"""
    deploy(job_name, ["preempt-then-sleep", "3"], max_retries=0)
    ti = run_execute(retries=3, wait_timeout=1.5, max_preemption_reruns=1, deferrable=deferrable)
    assert ti.state == TaskInstanceState.FAILED and ti.try_number >= 2
    error = CAPTURED["errors"][-1]
    assert isinstance(error, CloudRunGpuFatalError) and error.outcome == "PREEMPTED"
    assert "preemption budget exhausted (1 re-runs used)" in str(error)
    assert envs(job_name, RERUN_ENV) == ["1", "0"]
    assert len(set(envs(job_name, RUN_KEY_ENV))) == 1


@pytest.mark.parametrize(("args", "expected"), [(["sleep", "4"], 1), (["preempt-then-sleep", "4"], 2)])
def test_no_duplicate_execution_with_503s_and_a_retry_mid_execution(
    gcp_conn, job_name, run_execute, faults, monkeypatch, args, expected
):
    """A quarter of the API calls fail (503/429) and try 1 gives up waiting while the execution runs."""
    from airflow_gpu_resilience.hooks import cloud_run, cloud_run_executions, cloud_run_retry

    quick = functools.partial(cloud_run_retry.default_retry, initial=0.05)
    for module in (cloud_run, cloud_run_executions):  # the jobs half and the executions half of the hook
        monkeypatch.setattr(module, "default_retry", quick)
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
