"""Orchestration faults through the emulator and the provider's operators (``dag.test()``).

503/429 storms and delays from the API, RunJob applied but its answer lost (500/504), the
Airflow task killed (SIGKILL, no ``on_kill``) and retried mid-execution, every task of a 3-task
execution preempted at once, an attempt that ended between two polls (UNOBSERVED), a preemption
during the very first step, a preemption budget of 0. Each case counts the executions started (no
duplicates), and asserts the outcome and the message a user sees.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from airflow.utils.state import TaskInstanceState

from airflow_gpu_resilience.exceptions import CloudRunGpuFatalError
from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.overrides import START_ID_ENV, execution_env
from airflow_gpu_resilience.operators.cloud_run import RERUN_ENV, CloudRunGpuExecuteJobOperator
from tests.provider.conftest import PROJECT, REGION, wait_until_running
from tests.provider.operators import dag_factory
from tests.provider.operators.conftest import deploy, executions
from tests.provider.operators.dag_factory import CAPTURED, write_dag_file
from tests.worker.conftest import REPO_ROOT

pytestmark = [pytest.mark.faults, pytest.mark.usefixtures("airflow_db")]


@pytest.fixture(autouse=True)
def _clear_captured():
    CAPTURED["summaries"].clear()
    CAPTURED["errors"].clear()


@pytest.fixture
def fast_retries(monkeypatch):
    """The hook's API retry backoff starts at 50 ms (the storms would otherwise cost minutes)."""
    from airflow_gpu_resilience.hooks import cloud_run, cloud_run_executions, cloud_run_retry

    quick = functools.partial(cloud_run_retry.default_retry, initial=0.05)
    for module in (cloud_run, cloud_run_executions):  # the jobs half and the executions half of the hook
        monkeypatch.setattr(module, "default_retry", quick)


@pytest.fixture
def run_execute(job_name):
    """Run the execute DAG for ``job_name`` with ``dag.test()``; return its ``execute`` task instance."""
    from airflow.configuration import conf

    written = []

    def run(**kwargs):
        kwargs = {"dag_id": f"faults_{job_name.replace('-', '_')}", "job_name": job_name, **kwargs}
        written.append(write_dag_file(Path(conf.get("core", "dags_folder")), "execute_dag", kwargs))
        return dag_factory.execute_dag(**kwargs).test().get_task_instance("execute")

    yield run
    for path in written:
        path.unlink(missing_ok=True)


def start_ids(job_name: str) -> set:
    return {execution_env(e).get(START_ID_ENV) for e in executions(job_name)}


def in_background(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def preempt_when_running(job_name: str, emulator, injected: list, *, grace_seconds: float,
                         after_seconds: float = 0.0) -> threading.Thread:
    """In the background: once task 0 of the job's first execution runs, wait ``after_seconds``,
    then preempt it with ``grace_seconds``; the emulator's answer goes into ``injected``."""
    def preempt():
        execution = first_execution(job_name)
        wait_until_running(CloudRunGpuHook(), execution, timeout=60)
        time.sleep(after_seconds)
        injected.append(emulator.preempt(execution, task_index=0, grace_seconds=grace_seconds))

    return in_background(preempt)


def first_execution(job_name: str, timeout: float = 60.0) -> str:
    hook, deadline = CloudRunGpuHook(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = hook.list_executions(job_name=job_name, region=REGION, project_id=PROJECT)
        if found:
            return found[-1].name
        time.sleep(0.05)
    raise TimeoutError(f"no execution of {job_name} within {timeout} s")


@pytest.mark.parametrize("storm", [
    {"errorRate": 0.3, "codes": [503, 429], "seed": 11},
    {"failNext": 6, "codes": [429], "delaySeconds": 0.05},
    {"errorRate": 0.15, "codes": [503], "delaySeconds": 0.1, "seed": 3},
], ids=["503-429-storm", "429-burst-with-delay", "slow-503s"])
def test_api_storms_neither_duplicate_nor_lose_an_execution(gcp_conn, job_name, run_execute, faults, fast_retries,
                                                             storm):
    """A preempted first execution and its re-run, under API errors and delays: exactly two executions."""
    deploy(job_name, ["preempt-once"], max_retries=0)
    faults(**storm)
    ti = run_execute(retries=3, max_preemption_reruns=1, poll_interval=0.1)
    faults()
    assert ti.state == TaskInstanceState.SUCCESS, CAPTURED["errors"]
    [summary] = CAPTURED["summaries"]
    assert summary["outcome"] == "SUCCEEDED" and summary["reruns"] == 1
    assert [e["action"] for e in summary["executions"]] == ["RERUN", "SUCCEED"]
    assert len(executions(job_name)) == 2 and len(start_ids(job_name)) == 2


@pytest.mark.parametrize("code", [500, 504])
def test_runjob_applied_but_its_answer_lost_starts_exactly_one_execution(gcp_conn, job_name, run_execute, faults,
                                                                          fast_retries, code):
    """RunJob takes effect, but its answer is lost (the emulator applies it, then answers 500 or
    504): the operator must find that execution by its start id, not start a second one."""
    deploy(job_name, ["ok"], max_retries=0)
    faults(loseAnswerNext=1, loseAnswerCode=code)
    ti = run_execute(retries=0, poll_interval=0.1)
    faults()
    assert ti.state == TaskInstanceState.SUCCESS, CAPTURED["errors"]
    [summary] = CAPTURED["summaries"]
    assert summary["outcome"] == "SUCCEEDED" and [e["action"] for e in summary["executions"]] == ["SUCCEED"]
    assert len(executions(job_name)) == 1 and len(start_ids(job_name)) == 1


def test_lost_answers_of_a_preempted_run_and_its_rerun_still_give_two_executions(gcp_conn, job_name, run_execute,
                                                                                  faults, fast_retries):
    """Both RunJobs (the first execution, preempted, and its re-run) lose their answers."""
    deploy(job_name, ["preempt-once"], max_retries=0)
    faults(loseAnswerNext=2)
    ti = run_execute(retries=0, max_preemption_reruns=1, poll_interval=0.1)
    faults()
    assert ti.state == TaskInstanceState.SUCCESS, CAPTURED["errors"]
    [summary] = CAPTURED["summaries"]
    assert [e["action"] for e in summary["executions"]] == ["RERUN", "SUCCEED"]
    assert len(executions(job_name)) == 2 and len(start_ids(job_name)) == 2


KILLED_TRY = r"""
import sys
from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuExecuteJobOperator
class TI:
    dag_id, run_id, task_id, map_index = "faults_kill", "run-1", "execute", -1
    def xcom_push(self, key, value):
        print("xcom", key, value, flush=True)
op = CloudRunGpuExecuteJobOperator(task_id="execute", job_name=sys.argv[1], region=sys.argv[2],
                                   deferrable=False, poll_interval=0.1)
op.execute({"ti": TI()})
"""


class _TI:
    dag_id, run_id, task_id, map_index = "faults_kill", "run-1", "execute", -1

    def __init__(self):
        self.xcom = {}

    def xcom_push(self, key, value):
        self.xcom[key] = value


def test_airflow_task_killed_mid_execution_and_retried_attaches(gcp_conn, job_name, emulator):
    """Try 1 (its own process) is SIGKILLed while the execution runs: no ``on_kill``, nothing
    cancelled. Try 2 attaches to the same execution, which is preempted once and then succeeds."""
    deploy(job_name, ["sleep-first", "4", "0.5"], max_retries=1)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    first = subprocess.Popen([sys.executable, "-c", KILLED_TRY, job_name, REGION], env=env, cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        execution = first_execution(job_name)
        wait_until_running(CloudRunGpuHook(), execution, timeout=60)
    finally:
        first.kill()
        first.communicate(timeout=30)
    op = CloudRunGpuExecuteJobOperator(task_id="execute", job_name=job_name, region=REGION, deferrable=False,
                                       poll_interval=0.1)
    ti = _TI()
    emulator.preempt(execution, task_index=0, grace_seconds=0.2)
    summary = op.execute({"ti": ti})
    assert ti.xcom["execution_name"] == execution
    assert summary["outcome"] == "SUCCEEDED" and summary["reruns"] == 0
    assert [e["name"] for e in summary["executions"]] == [execution]
    assert summary["tasks"][0]["outcomes"] == ["PREEMPTED", "SUCCEEDED"]
    assert len(executions(job_name)) == 1


def test_every_task_of_a_3_task_execution_preempted_at_once(gcp_conn, job_name, emulator, run_execute):
    """All three tasks are preempted together; Cloud Run's retries bring each back in the same
    execution: one execution, no re-run, every task's two attempts reported in order.

    The API keeps only a task's last attempt result, so a poll that comes after a retry has
    already ended sees the preempted attempt as UNOBSERVED (on two busy xdist workers the 0.1 s
    poll once came later than a 0.5 s retry): each retry runs 3 s so that polls see most of them,
    and the test holds whichever way each one went."""
    deploy(job_name, ["sleep-first", "60", "3"], max_retries=1, task_count=3)
    hook, injected = CloudRunGpuHook(), []

    def preempt_all():
        execution = first_execution(job_name)
        for index in range(3):
            wait_until_running(hook, execution, task_index=index, timeout=60)
        threads = [in_background(functools.partial(
            lambda i: injected.append(emulator.preempt(execution, task_index=i, grace_seconds=0.3)), index))
            for index in range(3)]
        for thread in threads:
            thread.join(timeout=30)

    thread = in_background(preempt_all)
    ti = run_execute(max_preemption_reruns=0, poll_interval=0.1)
    thread.join(timeout=30)
    assert len(injected) == 3
    assert ti.state == TaskInstanceState.SUCCESS, CAPTURED["errors"]
    [summary] = CAPTURED["summaries"]
    assert summary["reruns"] == 0 and len(summary["executions"]) == 1 and summary["task_count"] == 3
    for task in summary["tasks"]:
        assert task["outcomes"][1:] == ["SUCCEEDED"], summary["tasks"]
        assert task["outcomes"][0] in ("PREEMPTED", "UNOBSERVED"), summary["tasks"]
    seen = [t["index"] for t in summary["tasks"] if t["outcomes"][0] == "PREEMPTED"]
    assert seen and sorted(p["task_index"] for p in summary["preemptions"]) == seen, summary["tasks"]
    assert all("hardware maintenance" in p["message"] for p in summary["preemptions"])
    assert len(executions(job_name)) == 1


def test_an_attempt_that_ended_between_two_polls_is_reported_unobserved(gcp_conn, job_name, emulator,
                                                                         run_execute, capfd):
    """Polls 25 s apart; the first attempt is preempted 5 s after it starts (after the polls at
    the start, the operator's and the trigger's first) and its 0.5 s retry succeeds long before
    the next poll, so the API's ``last_attempt_result`` never shows the preemption. The summary
    still lists both attempts, the first as UNOBSERVED (not a preemption, not lost), and the
    task log says why and what to change. (Polls 8 s apart with the preemption at once: a busy
    machine's trigger once polled between the preemption and the retry's end.)"""
    deploy(job_name, ["sleep-first", "60", "0.5"], max_retries=1)
    injected = []
    thread = preempt_when_running(job_name, emulator, injected, grace_seconds=0.2, after_seconds=5)
    ti = run_execute(max_preemption_reruns=0, poll_interval=25)
    thread.join(timeout=30)
    assert injected and ti.state == TaskInstanceState.SUCCESS, CAPTURED["errors"]
    [summary] = CAPTURED["summaries"]
    [task] = summary["tasks"]
    assert task["outcomes"] == ["UNOBSERVED", "SUCCEEDED"] and task["attempts"] == 2, summary["tasks"]
    assert task["exit_codes"] == [None, 0] and summary["preemptions"] == []
    assert [a["attempt"] for a in summary["attempts"]] == [0, 1]
    assert len(executions(job_name)) == 1
    out, err = capfd.readouterr()
    assert "task 0 attempt 0: UNOBSERVED" in out + err and "shorter poll_interval" in out + err


# serial: the preemption must land the moment the first attempt starts; beside another test on a
# shared core it can land too late, and the summary then shows attempt 0 as SUCCEEDED only.
@pytest.mark.serial
def test_preemption_during_the_very_first_step(gcp_conn, job_name, emulator, run_execute):
    """Preempted the moment the first attempt starts (grace 0): the retry succeeds."""
    deploy(job_name, ["sleep-first", "60", "0.2"], max_retries=1)
    injected = []
    thread = preempt_when_running(job_name, emulator, injected, grace_seconds=0)
    ti = run_execute(max_preemption_reruns=1, poll_interval=0.1)
    thread.join(timeout=30)
    assert injected and ti.state == TaskInstanceState.SUCCESS, CAPTURED["errors"]
    [summary] = CAPTURED["summaries"]
    # attempt 0 ends at once (grace 0) and Cloud Run retries it at once: a poll sees it ended
    # (PREEMPTED) only when it falls in that moment, else its record says so (UNOBSERVED, also
    # with the test alone on the machine); either way it is accounted for
    outcomes = summary["tasks"][0]["outcomes"]
    assert outcomes in (["PREEMPTED", "SUCCEEDED"], ["UNOBSERVED", "SUCCEEDED"]), outcomes
    assert len(executions(job_name)) == 1


def test_preemption_budget_of_zero_fails_at_the_first_preemption(gcp_conn, job_name, run_execute):
    """Budget 0 and no Cloud Run retries: the first preemption fails the task for good (no Airflow
    retry, no re-run), with a message that says so."""
    deploy(job_name, ["preempt-once"], max_retries=0)
    ti = run_execute(retries=2, max_preemption_reruns=0)
    assert ti.state == TaskInstanceState.FAILED and ti.try_number == 1
    error = CAPTURED["errors"][-1]
    assert isinstance(error, CloudRunGpuFatalError) and error.outcome == "PREEMPTED"
    assert "preemption budget exhausted (0 re-runs used)" in str(error)
    [execution] = executions(job_name)
    assert execution_env(execution).get(RERUN_ENV, "0") == "0"
    assert str(error).isprintable(), repr(str(error))  # one plain line: no control characters
