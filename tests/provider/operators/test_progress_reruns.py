"""Progress-aware re-runs and task-timeout chaining against the emulator.

- A training of several task timeouts (68 s of steps, a 12 s task timeout, ``max_retries`` 1)
  finishes through at least four TIMED_OUT executions, each attempt checkpointing the step it
  stopped at before its deadline and exiting 143 itself, on a fixed budget of 0: the re-runs
  that make progress are free (issue 16's chain, compressed further: what it shows depends on
  the number of deadline stops, not on their length). An Airflow retry mid-chain is shown in the
  real deployment (``tests/deployment``, the non-deferrable scenario).
- A job that never commits a newer checkpoint ends after exactly ``max_reruns_without_progress``
  re-runs, with an error naming the step, the classes and what to check.
- A failed task's goodput account, with the real worker: the steps it never committed are
  wasted.
- The deployed job carries ``TASK_TIMEOUT_SECONDS`` = its task timeout; a per-execution
  ``timeout`` override sets it for that execution, and the task sees it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow.utils.state import TaskInstanceState

from airflow_gpu_resilience.exceptions import CloudRunGpuFatalError
from airflow_gpu_resilience.goodput import BUCKETS
from airflow_gpu_resilience.hooks.cloud_run import CloudRunGpuHook
from airflow_gpu_resilience.overrides import START_ID_ENV, execution_env
from airflow_gpu_resilience.job_spec import GpuJobSpec
from airflow_gpu_resilience.operators.cloud_run import START_STEPS_ENV, CloudRunGpuExecuteJobOperator
from tests.provider.conftest import BUCKET, PROJECT, REGION, STUB_IMAGE, bucket_dir, point_connection
from tests.provider.operators.dag_factory import CAPTURED
from tests.logs import worker_records

pytestmark = pytest.mark.usefixtures("airflow_db")
#: For the bundled worker's runs against task deadlines (scripts/run_tests.sh runs them alone):
#: another test beside them slowed the worker's start-up past its deadline. The stand-in task's
#: runs (a ``python -c`` stub, 2 s task timeouts) share the cores as the other operator tests do.
SERIAL = pytest.mark.serial

REPO = Path(__file__).resolve().parents[3]
#: The bundled worker (``python -m gpu_resilience_trainer train``) in :func:`worker_emulator`'s table.
WORKER_IMAGE = "test.local/worker:latest"

#: Steps of the chained training, 0.4 s each (``CHAIN_STEPS`` changes it): 68 s of steps. An
#: attempt stops at its deadline :data:`CHAIN_GRACE` seconds before its task timeout, 8 s after it
#: started, so it trains less than 8 s: eight attempts (four executions of two) train less than
#: 64 s whatever the worker's start-up takes, so they cannot finish and at least four executions
#: end TIMED_OUT on idle cores too (with 52 s of steps, an idle machine's attempts, starting in
#: about 1.5 s, finished in the fourth execution); on busy cores an attempt trains less and it
#: takes more.
CHAIN_STEPS = int(os.environ.get("CHAIN_STEPS", "170"))
#: The chain's task timeout in seconds (``CHAIN_TASK_TIMEOUT``; raise it, and ``CHAIN_STEPS`` in
#: proportion, on a machine so loaded that the worker's start-up takes most of its deadline).
CHAIN_TASK_TIMEOUT = int(os.environ.get("CHAIN_TASK_TIMEOUT", "12"))
#: The chain's ``PREEMPTION_GRACE_SECONDS``: the worker stops this long before its task timeout
#: (the whole grace while it is at most half the timeout), time enough for its save and exit.
CHAIN_GRACE = 4


@contextlib.contextmanager
def emulator_with_images(folder: Path, monkeypatch, images: dict, transport: str) -> Iterator:
    """An emulator of its own in ``folder`` with Cloud Run's 10 s SIGTERM-to-SIGKILL grace (the
    session's has 1 s), the bundled worker as ``WORKER_IMAGE`` and ``images`` (more image-table
    entries, see ``cloud_run_emulator.images``); the connection points at it over ``transport``
    (:func:`~tests.provider.conftest.point_connection`, as ``gcp_conn`` does for the session's
    emulator) and ``STORAGE_EMULATOR_HOST`` too, the bucket holds the digits data set."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from cloud_run_emulator.process import EmulatorProcess
    from tests.worker.conftest import write_digits

    worker = {"entrypoint": ["{python}", "-m", "gpu_resilience_trainer"], "cmd": ["train"], "cwd": str(REPO),
              "env": {"PYTHONPATH": f"{REPO / 'worker'}{os.pathsep}{REPO}"}}
    table = folder / "images.json"
    table.write_text(json.dumps({"images": {WORKER_IMAGE: worker, **images}}))
    with EmulatorProcess(folder / "state", images_file=table, grace_seconds=10.0) as emu:
        storage.Client(project=PROJECT, credentials=AnonymousCredentials(),
                       client_options={"api_endpoint": emu.gcs_endpoint}).create_bucket(BUCKET)
        write_digits(bucket_dir(emu) / "data" / "digits.npz")
        point_connection(monkeypatch, emu, transport)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.gcs_endpoint)
        yield emu


@pytest.fixture
def worker_emulator(tmp_path, monkeypatch, transport):
    """:func:`emulator_with_images` with the bundled worker alone, once per transport."""
    with emulator_with_images(tmp_path, monkeypatch, {}, transport) as emu:
        yield emu


def deploy(job_name: str, image: str, args: list[str], **kw) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = GpuJobSpec(name=job_name, image=image, args=args, checkpoint_bucket=BUCKET, **kw)
    CloudRunGpuHook().create_job(job_name=job_name, job=spec, region=REGION, project_id=PROJECT)


def executions(job_name: str) -> list:
    """Oldest first."""
    return list(reversed(CloudRunGpuHook().list_executions(job_name=job_name, region=REGION, project_id=PROJECT)))


class _TI:
    dag_id, run_id, task_id, map_index = "progress_chain", "run-1", "execute", -1

    def __init__(self):
        self.xcom = {}
        self.pushed: list[tuple[str, object]] = []  # every push, in order (a re-run pushes again)

    def xcom_push(self, key, value):
        self.xcom[key] = value
        self.pushed.append((key, value))



def _check_chained_attempt(attempt: dict, events: list[dict], resumed_from: int, last: bool, where: str) -> int:
    """One attempt of the task-timeout chain, as the emulator recorded it (``attempt``) and as the
    worker logged it (``events``): it resumed from ``resumed_from`` (the previous stop's
    checkpoint: no lost step) and was never sent SIGTERM. The last one trains to the end; every
    other one stops at its own deadline, checkpoints the step it stopped at and exits 143, all
    before the task timeout (the emulator never stopped it). An attempt whose deadline came
    during its start-up (a loaded machine's slow imports) exits 143 before its restore, having
    trained nothing.

    :returns: the step the next attempt must resume from.
    """
    messages = [e["message"] for e in events]
    where = f"{where}: {messages}"
    assert "SIGTERM received" not in " ".join(messages), where
    start = next((e for e in events if e["message"].startswith(("resuming from step", "no checkpoint found"))), None)
    if not last:
        assert (attempt["exitCode"], attempt["termSignal"], attempt["stopReason"]) == (143, None, None), attempt
        assert attempt["seconds"] < CHAIN_TASK_TIMEOUT, attempt
        if start is None:
            assert "DEADLINE received during start-up; exiting before the restore" in messages, where
            return resumed_from
    assert start is not None and start["resumed_from_step"] == resumed_from, where
    if last:
        assert attempt["exitCode"] == 0 and "training complete" in messages, where
        return resumed_from
    [stop] = [i for i, e in enumerate(events) if e["message"].startswith("DEADLINE received; stopping at step")]
    step = events[stop]["step"]
    assert step > resumed_from, where  # it trained before its deadline
    [exit_] = [i for i, e in enumerate(events) if e["message"] == "exiting: interrupted, resumable"]
    assert stop < exit_ and events[exit_]["step"] == events[exit_]["last_checkpoint_step"] == step, where
    assert any(e["message"] in ("checkpoint saved", "nothing new to checkpoint") and e.get("step") == step
               for e in events[stop:exit_]), where
    return step


@SERIAL
# over gRPC only (the clients' default): what this chain adds is the worker's deadline stops over
# eight attempts; a TIMED_OUT execution re-run by its progress runs on both transports in
# test_no_new_checkpoint_ends_after_max_reruns_without_progress, and this chain is the slowest test
@pytest.mark.parametrize("transport", ["grpc"], indirect=True)
def test_a_training_of_about_five_task_timeouts_finishes_through_timed_out_executions(worker_emulator, job_name):
    """Issue 16, must-show 1: task timeout ``CHAIN_TASK_TIMEOUT`` (the override; the job's own is
    10 s longer), ``CHAIN_STEPS`` training steps at 0.4 s, ``max_retries`` 1: the job finishes
    through at least four TIMED_OUT executions (two deadline stops each), every interrupted
    attempt checkpointing at the step it stopped at before its deadline and exiting 143 itself
    (the emulator never had to stop it), the next attempt resuming from exactly that step (no
    lost steps; :func:`_check_chained_attempt`). The budget is not used up: a fixed budget of 0 (no re-run could be charged to
    it) and the default 2 re-runs without progress, since every execution committed a newer
    checkpoint. The summary's ``chain`` shows every execution, oldest first."""
    deploy(job_name, WORKER_IMAGE, ["train", "--steps", str(CHAIN_STEPS), "--step-delay", "0.4",
                                    "--checkpoint-every", "20", "--sync-save"],
           max_retries=1, task_timeout=CHAIN_TASK_TIMEOUT + 10, env={"PREEMPTION_GRACE_SECONDS": str(CHAIN_GRACE)})
    job = CloudRunGpuHook().get_job(job_name=job_name, region=REGION, project_id=PROJECT)
    assert {e.name: e.value for e in job.template.template.containers[0].env}["TASK_TIMEOUT_SECONDS"] == str(
        CHAIN_TASK_TIMEOUT + 10)
    op = CloudRunGpuExecuteJobOperator(task_id="execute", job_name=job_name, region=REGION, deferrable=False,
                                       poll_interval=0.2, checkpoint_bucket=BUCKET,
                                       overrides={"timeout": f"{CHAIN_TASK_TIMEOUT}s"}, max_preemption_reruns=0)
    ti = _TI()
    summary = op.execute({"ti": ti})

    # the summary shows the chain: every execution, oldest first, TIMED_OUT until the last
    found = executions(job_name)
    chain = summary["chain"]
    assert [c["name"] for c in chain] == [e.name for e in found]  # no duplicate, no orphan
    assert [value for key, value in ti.pushed if key == "execution_name"] == [e.name for e in found]
    assert len({execution_env(e)[START_ID_ENV] for e in found}) == len(found)
    timed_out = len(chain) - 1
    assert timed_out >= 4, f"{timed_out} TIMED_OUT execution(s), expected at least 4: {chain}"
    assert [c["outcome"] for c in chain] == ["TIMED_OUT"] * timed_out + ["SUCCEEDED"], chain
    assert summary["outcome"] == "SUCCEEDED" and summary["reruns"] == timed_out
    # the budget is not used up: every execution made progress, so no re-run counted against
    # max_reruns_without_progress, and the fixed budget of 0 was never charged
    assert chain[0]["start_steps"] == {}
    for before, after in zip(chain, chain[1:]):
        assert before["end_steps"] == after["start_steps"]
        assert int(after["start_steps"]["0"]) > int((before["start_steps"] or {}).get("0", 0)), chain
    assert all(entry["progress"] is True for entry in chain), chain
    assert summary["reruns"] < op.max_total_reruns
    assert chain[-1]["end_steps"] == {"0": CHAIN_STEPS} and summary["progress"]["0"]["step"] == CHAIN_STEPS
    for execution in found:  # each execution carries the override's timeout, to the container too
        assert execution.template.timeout.total_seconds() == CHAIN_TASK_TIMEOUT
        assert execution_env(execution)["TASK_TIMEOUT_SECONDS"] == str(CHAIN_TASK_TIMEOUT)

    # every attempt, as the emulator recorded it and as the worker logged it, oldest first
    attempts = [(e, a) for e in found for a in worker_emulator.attempts(e.name)]
    assert len(attempts) == 2 * timed_out + len(worker_emulator.attempts(found[-1].name))  # max_retries 1
    resumed_from = 0
    for number, (execution, attempt) in enumerate(attempts):
        log = worker_emulator.data_dir / "logs" / execution.name.rsplit("/", 1)[-1] / attempt["log"]
        resumed_from = _check_chained_attempt(attempt, worker_records(log.read_text()), resumed_from,
                                              last=number == len(attempts) - 1, where=f"attempt {number} ({log})")
    assert summary["lost_steps_total"] == 0


@pytest.mark.parametrize(("args", "stuck", "streak", "starts"), [
    (["sleep", "60"], "stuck at step 0 (no committed checkpoint yet)", 3, ["", "", ""]),
    (["commit-then-stall", "60"], "stuck at step 40 (task 0)", 2, ["", "0=40", "0=40"]),
], ids=["never-commits", "stuck-after-one-checkpoint"])
def test_no_new_checkpoint_ends_after_max_reruns_without_progress(
    gcp_conn, gcs_emulator_host, job_name, run_execute, capfd, args, stuck, streak, starts, monkeypatch
):
    """Must-show 2: a task timeout (2 s) shorter than the checkpoint interval. Exactly
    ``max_reruns_without_progress`` (2) re-runs, none committing a newer checkpoint: after a
    first execution that committed nothing, or one that committed step 40 and then nothing more.
    The failed task's goodput account (issue 16, item b) is logged before the error is raised,
    ends its message and travels on it: every attempt's time, as Cloud Run recorded it, is
    start-up (the stub never reaches a training step)."""
    deploy(job_name, STUB_IMAGE, args, max_retries=0, task_timeout=2)
    lookups = []  # the task instance's own executions, looked up (a ListExecutions each)
    find = CloudRunGpuHook.find_executions
    monkeypatch.setattr(CloudRunGpuHook, "find_executions", lambda *a, **kw: lookups.append(kw) or find(*a, **kw))
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
    assert len(lookups) == 1 + len(found)  # one before the first start, one per finished execution
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


@SERIAL
def test_a_failed_tasks_account_counts_its_uncommitted_steps_as_wasted(worker_emulator, job_name, capfd):
    """Issue 16 item b with the real worker: one attempt trains without checkpointing until its
    deadline stop (task timeout ``CHAIN_TASK_TIMEOUT``), so the execution makes no progress and, with
    ``max_reruns_without_progress`` 0, the task fails at once. Its account, built before the error
    is raised, counts the steps the worker says it stopped at (its own log line) as wasted: none
    of them was committed."""
    deploy(job_name, WORKER_IMAGE, ["train", "--steps", "5000", "--step-delay", "0.05", "--checkpoint-every", "0"],
           max_retries=0, task_timeout=CHAIN_TASK_TIMEOUT, env={"PREEMPTION_GRACE_SECONDS": str(CHAIN_GRACE)})
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
    # nothing was committed: every training second is wasted, the steps' measured time and the rest
    assert account["productive"] == 0 and row["step_seconds"] >= 0.05
    assert account["wasted"] >= stopped * row["step_seconds"] - 1e-6
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
def test_templated_rerun_limits_are_checked_once_rendered(name, gcp_conn):
    op = CloudRunGpuExecuteJobOperator(task_id="e", job_name="j", **{name: "{{ params.n }}"})
    assert name in op.template_fields
    setattr(op, name, "-2")  # as rendered
    with pytest.raises(ValueError, match=f"{name}='-2' must be an integer >= 0"):
        op.execute({})
    setattr(op, name, "5")
    assert op.run_manager(None).settings.max_preemption_reruns == 3  # the fixed budget stays max_preemption_reruns
