"""Progress-aware re-runs and task-timeout chaining against the emulator.

- A training that needs several task timeouts finishes through a chain of TIMED_OUT executions,
  each attempt checkpointing before its deadline and exiting 143 itself, on a fixed budget of 0:
  the re-runs that make progress are free. The operator is restarted mid-chain (its first try
  SIGKILLed in its own process) and the second try counts progress from what Cloud Run and the
  bucket show. About 100 s (the bundled worker, startup included).
- A job that never commits a newer checkpoint ends after exactly ``max_reruns_without_progress``
  re-runs, with an error naming the step, the classes and what to check. About 20 s each.
- A failed task's goodput account, with the real worker: the steps it never committed are
  wasted. About 25 s.
- The deployed job carries ``TASK_TIMEOUT_SECONDS`` = its task timeout; a per-execution
  ``timeout`` override sets it for that execution, and the task sees it. About 2 s.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from airflow.utils.state import TaskInstanceState

from airflow_gpu_resilience.exceptions import CloudRunGpuFatalError
from airflow_gpu_resilience.goodput import BUCKETS
from airflow_gpu_resilience.hooks.cloud_run import START_ID_ENV, CloudRunGpuHook, execution_env
from airflow_gpu_resilience.job_spec import GpuJobSpec
from airflow_gpu_resilience.operators.cloud_run import START_STEPS_ENV, CloudRunGpuExecuteJobOperator
from tests.provider.conftest import BUCKET, PROJECT, REGION, STUB_IMAGE, bucket_dir
from tests.provider.operators.dag_factory import CAPTURED
from tests.provider.operators.test_cloud_run import _clear_captured, run_dag, run_execute  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("airflow_db")

REPO = Path(__file__).resolve().parents[3]
#: The bundled worker (``python -m gpu_resilience_worker train``) in :func:`worker_emulator`'s table.
WORKER_IMAGE = "test.local/worker:latest"

#: Steps of the chained training, 0.4 s each (``CHAIN_STEPS`` changes it): 60 s of steps plus
#: the worker's start-up in every attempt take five or six 20 s attempts on 2 idle cores.
CHAIN_STEPS = int(os.environ.get("CHAIN_STEPS", "150"))
#: The chain's task timeout in seconds (``CHAIN_TASK_TIMEOUT``; raise it on a machine so loaded
#: that the worker's start-up takes most of 15 s).
CHAIN_TASK_TIMEOUT = int(os.environ.get("CHAIN_TASK_TIMEOUT", "20"))


@pytest.fixture
def worker_emulator(tmp_path, monkeypatch):
    """An emulator of its own with Cloud Run's 10 s SIGTERM-to-SIGKILL grace (the session's has
    1 s) and the bundled worker as ``WORKER_IMAGE``; the connection and ``STORAGE_EMULATOR_HOST``
    point at it. About 3 s to start."""
    import json

    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from airflow_gpu_resilience.emulator.process import EmulatorProcess
    from tests.worker.conftest import write_digits

    worker = {"entrypoint": ["{python}", "-m", "gpu_resilience_worker"], "cmd": ["train"], "cwd": str(REPO),
              "env": {"PYTHONPATH": f"{REPO / 'worker'}{os.pathsep}{REPO}"}}
    table = tmp_path / "images.json"
    table.write_text(json.dumps({"images": {WORKER_IMAGE: worker}}))
    with EmulatorProcess(tmp_path / "state", images_file=table, grace_seconds=10.0) as emu:
        storage.Client(project=PROJECT, credentials=AnonymousCredentials(),
                       client_options={"api_endpoint": emu.gcs_endpoint}).create_bucket(BUCKET)
        write_digits(bucket_dir(emu) / "data" / "digits.npz")
        extra = {"is_anonymous": True, "project": PROJECT, "api_endpoint": emu.endpoint}
        monkeypatch.setenv("AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT",
                           json.dumps({"conn_type": "google_cloud_platform", "extra": extra}))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.gcs_endpoint)
        yield emu


def deploy(job_name: str, image: str, args: list[str], **kw) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = GpuJobSpec(name=job_name, image=image, args=args, checkpoint_bucket=BUCKET, **kw)
    CloudRunGpuHook().create_job(job_name=job_name, job=spec, region=REGION, project_id=PROJECT)


def executions(job_name: str) -> list:
    """Oldest first."""
    return list(reversed(CloudRunGpuHook().list_executions(job_name=job_name, region=REGION, project_id=PROJECT)))


FIRST_TRY = r"""
import json, sys
from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuExecuteJobOperator
class TI:
    dag_id, run_id, task_id, map_index = "progress_chain", "run-1", "execute", -1
    def xcom_push(self, key, value):
        print("xcom", key, value, flush=True)
op = CloudRunGpuExecuteJobOperator(task_id="execute", job_name=sys.argv[1], region=sys.argv[2], deferrable=False,
                                   poll_interval=0.2, checkpoint_bucket=sys.argv[3], overrides=json.loads(sys.argv[4]),
                                   max_preemption_reruns=0)
op.execute({"ti": TI()})
"""


class _TI:
    dag_id, run_id, task_id, map_index = "progress_chain", "run-1", "execute", -1

    def __init__(self):
        self.xcom = {}
        self.pushed: list[tuple[str, object]] = []  # every push, in order (a re-run pushes again)

    def xcom_push(self, key, value):
        self.xcom[key] = value
        self.pushed.append((key, value))


def test_a_chain_of_task_timeouts_finishes_through_a_restart(worker_emulator, job_name):
    """Must-show 1 and 3: task timeout 20 s (the override; the job's own is 30 s), max_retries 1,
    a fixed budget of 0 (and the default 2 re-runs without progress): the job still finishes, through
    several TIMED_OUT executions that each committed a newer checkpoint. Try 1 is SIGKILLed
    after it started a re-run; try 2 (a fresh operator) attaches to that re-run and reads the
    progress of try 1's executions from Cloud Run and the bucket."""
    deploy(job_name, WORKER_IMAGE, ["train", "--steps", str(CHAIN_STEPS), "--step-delay", "0.4",
                                    "--checkpoint-every", "20", "--sync-save"],
           max_retries=1, task_timeout=CHAIN_TASK_TIMEOUT + 10, env={"PREEMPTION_GRACE_SECONDS": "5"})
    job = CloudRunGpuHook().get_job(job_name=job_name, region=REGION, project_id=PROJECT)
    assert {e.name: e.value for e in job.template.template.containers[0].env}["TASK_TIMEOUT_SECONDS"] == str(
        CHAIN_TASK_TIMEOUT + 10)
    overrides = f'{{"timeout": "{CHAIN_TASK_TIMEOUT}s"}}'
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen([sys.executable, "-c", FIRST_TRY, job_name, REGION, BUCKET, overrides], env=env,
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(executions(job_name)) < 2 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(executions(job_name)) == 2, "try 1 did not start a re-run"
    finally:
        first.kill()
        out = first.communicate(timeout=30)[0]
    assert "Re-runs follow checkpoint progress" in out, out[-3000:]
    op = CloudRunGpuExecuteJobOperator(task_id="execute", job_name=job_name, region=REGION, deferrable=False,
                                       poll_interval=0.2, checkpoint_bucket=BUCKET, overrides={"timeout": f"{CHAIN_TASK_TIMEOUT}s"},
                                       max_preemption_reruns=0)
    ti = _TI()
    summary = op.execute({"ti": ti})

    found = executions(job_name)
    pushed = [value for key, value in ti.pushed if key == "execution_name"]
    assert pushed[0] == found[1].name  # try 2 attached to try 1's re-run (then started the next ones)
    assert pushed[-1] == found[-1].name
    chain = summary["chain"]
    assert [c["name"] for c in chain] == [e.name for e in found]  # no duplicate, no orphan
    assert len({execution_env(e)[START_ID_ENV] for e in found}) == len(found)
    assert len(chain) >= 2 and summary["reruns"] == len(chain) - 1  # more than the fixed budget of 0
    assert [c["outcome"] for c in chain] == ["TIMED_OUT"] * (len(chain) - 1) + ["SUCCEEDED"], chain
    assert chain[0]["start_steps"] == {}
    for before, after in zip(chain, chain[1:]):
        assert before["end_steps"] == after["start_steps"]
    for entry in chain:
        assert entry["progress"] is True, chain
    assert chain[-1]["end_steps"] == {"0": CHAIN_STEPS}
    for execution in found:  # each execution carries the override's timeout, to the container too
        assert execution.template.timeout.total_seconds() == CHAIN_TASK_TIMEOUT
        assert execution_env(execution)["TASK_TIMEOUT_SECONDS"] == str(CHAIN_TASK_TIMEOUT)
        assert START_STEPS_ENV in execution_env(execution)
    # every attempt of try 2's executions checkpointed and exited 143 itself at its deadline (or
    # finished): none was killed, no step was lost
    attempts = summary["attempts"]
    assert attempts and all(a["term_signal"] is None and a["exit_code"] in (143, 0) for a in attempts), attempts
    assert summary["lost_steps_total"] == 0 and summary["progress"]["0"]["step"] == CHAIN_STEPS
    # an execution's last attempt (its duration known) that exited 143 is a deadline stop
    timed_out = [a for a in attempts if a["exit_code"] == 143 and a["duration_seconds"] is not None]
    assert all(a["outcome"] == "TIMED_OUT" for a in timed_out), attempts
    # the worker's own logs, every attempt of the chain: each interrupted one stopped at its
    # deadline (not by the platform's SIGTERM) and checkpointed first
    logs = [p.read_text() for p in sorted((worker_emulator.data_dir / "logs").glob("*/task0-attempt*.log"))]
    assert len(logs) >= 2 * (len(chain) - 1) + 1  # max_retries 1: two attempts per TIMED_OUT execution
    stopped = [log for log in logs if "exiting: interrupted, resumable" in log]
    assert len(stopped) == len(logs) - 1
    assert all("DEADLINE received" in log and "SIGTERM received" not in log for log in stopped)
    assert all("checkpoint saved" in log or "nothing new to checkpoint" in log for log in stopped)


@pytest.mark.parametrize(("args", "stuck", "streak", "starts"), [
    (["sleep", "60"], "stuck at step 0 (no committed checkpoint yet)", 3, ["", "", ""]),
    (["commit-then-stall", "60"], "stuck at step 40 (task 0)", 2, ["", "0=40", "0=40"]),
], ids=["never-commits", "stuck-after-one-checkpoint"])
def test_no_new_checkpoint_ends_after_max_reruns_without_progress(
    gcp_conn, gcs_emulator_host, job_name, run_execute, capfd, args, stuck, streak, starts
):
    """Must-show 2: a task timeout (2 s) shorter than the checkpoint interval. Exactly
    ``max_reruns_without_progress`` (2) re-runs, none committing a newer checkpoint: after a
    first execution that committed nothing, or one that committed step 40 and then nothing more.
    The failed task's goodput account (issue 16, item b) is logged before the error is raised,
    ends its message and travels on it: every attempt's time, as Cloud Run recorded it, is
    start-up (the stub never reaches a training step)."""
    deploy(job_name, STUB_IMAGE, args, max_retries=0, task_timeout=2)
    ti = run_execute(retries=2, checkpoint_bucket=BUCKET, max_reruns_without_progress=2, max_preemption_reruns=10)
    assert ti.state == TaskInstanceState.FAILED and ti.try_number == 1
    error = CAPTURED["errors"][-1]
    assert isinstance(error, CloudRunGpuFatalError) and error.outcome == "TIMED_OUT"
    message = str(error)
    assert f"no new committed checkpoint in the last {streak} execution(s)" in message
    assert "2 re-run(s) without progress, max_reruns_without_progress=2" in message
    assert stuck in message and "their classes: " + ", ".join(["TIMED_OUT"] * streak) + "." in message
    assert "checkpoint interval against the task timeout (TASK_TIMEOUT_SECONDS)" in message
    assert "time between preemptions" in message
    found = executions(job_name)  # the first execution and exactly 2 re-runs
    assert [execution_env(e)[START_STEPS_ENV] for e in found] == starts
    report = error.goodput
    assert report is not None, message
    [account] = report["tasks"]
    tasks = [t for e in found for t in CloudRunGpuHook().list_tasks(execution=e.name)]
    platform = sum(t.completion_time.timestamp() - t.start_time.timestamp() for t in tasks)
    assert len(account["attempts"]) == len(found) == 3 and account["unknown_attempts"] == 0
    assert account["attempt_seconds"] == pytest.approx(platform, rel=1e-6) and platform > 0
    assert not any(a["reached_first_step"] for a in account["attempts"])
    assert account["startup"] == pytest.approx(account["attempt_seconds"]) and account["productive"] == 0
    assert account["gpu_seconds"] == pytest.approx(platform)  # one GPU per task, every attempt billed
    assert message.index(report["headline"]) < message.index(" Logs: ")
    assert "GPU-s billed over 3 attempt(s) of 1 task(s); productive 0.0 s" in report["headline"]
    out = capfd.readouterr()
    assert "Goodput account (seconds and share of each task's span)" in out.out + out.err
    assert report["table"].splitlines()[-1] in out.out + out.err


def test_a_failed_tasks_account_counts_its_uncommitted_steps_as_wasted(worker_emulator, job_name, capfd):
    """Issue 16 item b with the real worker: one attempt trains without checkpointing until its
    deadline stop (task timeout ``CHAIN_TASK_TIMEOUT``, 20 s), so the execution makes no progress and, with
    ``max_reruns_without_progress`` 0, the task fails at once. Its account, built before the error
    is raised, counts the steps the worker says it stopped at (its own log line) as wasted: none
    of them was committed. About 25 s (one emulator, one attempt)."""
    deploy(job_name, WORKER_IMAGE, ["train", "--steps", "5000", "--step-delay", "0.05", "--checkpoint-every", "0"],
           max_retries=0, task_timeout=CHAIN_TASK_TIMEOUT, env={"PREEMPTION_GRACE_SECONDS": "5"})
    op = CloudRunGpuExecuteJobOperator(task_id="execute", job_name=job_name, region=REGION, deferrable=False,
                                       poll_interval=0.2, checkpoint_bucket=BUCKET, max_reruns_without_progress=0)
    with pytest.raises(CloudRunGpuFatalError) as raised:
        op.execute({"ti": _TI()})
    error = raised.value
    assert error.outcome == "TIMED_OUT" and "max_reruns_without_progress=0" in str(error)
    [execution] = executions(job_name)
    [log] = (worker_emulator.data_dir / "logs" / execution.name.rsplit("/", 1)[-1]).glob("task0-attempt*.log")
    text = log.read_text()
    assert "no checkpoint at the stop" in text
    stopped = int(re.search(r'"message": "(?:DEADLINE|SIGTERM) received; stopping at step (\d+)"', text).group(1))
    [account] = error.goodput["tasks"]
    [row] = account["attempts"]
    assert stopped > 0 and row["reached_first_step"] and row["times_from"] == "platform"
    assert (row["steps_uncommitted"], account["steps_uncommitted"], account["steps_recomputed"]) == (stopped,) * 2 + (0,)
    assert account["wasted"] == pytest.approx(stopped * row["step_seconds"]) and row["step_seconds"] >= 0.05
    assert sum(account[b] for b in BUCKETS) == pytest.approx(account["span_seconds"])
    assert f"(0 steps recomputed, {stopped} uncommitted)" in str(error)
    out = capfd.readouterr()
    assert error.goodput["table"] in out.out + out.err  # logged, before the error was raised


def test_the_task_timeout_reaches_the_container_also_when_overridden(gcp_conn, job_name, emulator, run_execute):
    """Issue 15 item 4 (the deploy side): TASK_TIMEOUT_SECONDS is the job's task timeout, and an
    execution's ``timeout`` override sets it for that execution's tasks."""
    deploy(job_name, STUB_IMAGE, ["record-env", "TASK_TIMEOUT_SECONDS"], max_retries=0, task_timeout=45)
    job = CloudRunGpuHook().get_job(job_name=job_name, region=REGION, project_id=PROJECT)
    assert {e.name: e.value for e in job.template.template.containers[0].env}["TASK_TIMEOUT_SECONDS"] == "45"
    assert run_execute(overrides={"timeout": {"seconds": 12}}).state == TaskInstanceState.SUCCESS
    assert (bucket_dir(emulator) / f"{job_name}-env.txt").read_text() == "12"
    [execution] = executions(job_name)
    assert execution.template.timeout.total_seconds() == 12 and execution_env(execution)["TASK_TIMEOUT_SECONDS"] == "12"


@pytest.mark.parametrize("name", ["max_reruns_without_progress", "max_total_reruns", "max_preemption_reruns"])
@pytest.mark.parametrize("value", [-1, 1.5, True, None])
def test_rerun_limits_are_checked_when_the_dag_is_parsed(name, value):
    """One ValueError naming the parameter and the allowed values, from the constructor."""
    with pytest.raises(ValueError, match=f"^{name}={value!r} must be an integer >= 0$"):
        CloudRunGpuExecuteJobOperator(task_id="e", job_name="j", **{name: value})


@pytest.mark.parametrize("name", ["max_reruns_without_progress", "max_total_reruns"])
def test_templated_rerun_limits_are_checked_once_rendered(name):
    op = CloudRunGpuExecuteJobOperator(task_id="e", job_name="j", **{name: "{{ params.n }}"})
    assert name in op.template_fields
    setattr(op, name, "-2")  # as rendered
    with pytest.raises(ValueError, match=f"{name}='-2' must be an integer >= 0"):
        op.execute({})
    setattr(op, name, "5")
    assert op._budget() == 3  # the fixed budget stays max_preemption_reruns
