"""Every way in, chained by the execute operator (issue 35, must-show 1).

A ``transformers.Trainer`` job, a Lightning job (the documentation's framework examples, their
output folder the task folder) and an own loop through ``ResilientLoop`` (the user-image
example), each deployed with ``checkpoint_bucket`` and ``max_retries`` 0 and run by
:class:`~airflow_gpu_resilience.operators.cloud_run.CloudRunGpuExecuteJobOperator` against the
emulator. Each execution's task is preempted (maintenance, through the emulator, Cloud Run's
10 s grace) once a checkpoint newer than the one it started from is committed and the worker
reports a step past it: :data:`PREEMPTIONS` executions end PREEMPTED, each having made
progress, and the next one succeeds.

No stop saves its step, so every resume computes some steps again: the own loop is told
``--preemption-save=never``; a framework's save takes longer than the grace period its worker is
told (:data:`SAVE_PAUSE` before each commit record, ``tests.worker.frameworks``'s hook, against
:data:`GRACE`: the worker's estimate of a save, 1.5 times the measured one plus a margin, does not
fit), as a large model's would in Cloud Run's 10 s.

The summary must show each execution's progress (the ``chain``: committed steps rising, every
re-run free of ``max_preemption_reruns`` 0 because it made progress), the attempts, the task's
``progress.json``, the lost work and a goodput account whose rows carry the worker's events:
every attempt reached its first step, each resumed attempt restored a checkpoint, saves stalled
training, and the steps each resumed attempt recomputed are the lost steps ``attempts.json``
reports. Cost: six worker start-ups per test, a framework's import most of each.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pytest

from airflow_gpu_resilience.goodput import BUCKETS
from airflow_gpu_resilience.operators.cloud_run import CloudRunGpuExecuteJobOperator
from tests.conftest import require_module
from tests.provider.conftest import BUCKET, REGION, bucket_dir
from tests.provider.operators.test_goodput_billing import preempt_every_startup
from tests.provider.operators.test_progress_reruns import REPO, _TI, deploy, emulator_with_images, executions
from tests.worker.frameworks import EXAMPLES

pytestmark = pytest.mark.usefixtures("airflow_db")

#: Executions preempted; one more trains to the end.
PREEMPTIONS = 5
#: A framework worker's ``PREEMPTION_GRACE_SECONDS`` and the pause before each of its commit
#: records (``WORKER_TEST_PAUSE_BEFORE_COMMIT_SECONDS``): 1.5 x 1.5 + 0.5 s does not fit in 2.5 s.
GRACE, SAVE_PAUSE = "2.5", "1.5"
#: Seconds slept at each framework step's end (``WORKER_TEST_STEP_DELAY_SECONDS``): half a
#: checkpoint interval lasts about a second, which the test's polling needs to see a step
#: reported past a commit before the next one.
STEP_DELAY = "0.03"
#: A commit record's step: the last number in its name (``ckpt-00000040.commit.json``,
#: ``checkpoint-40.commit.json``, ``step-40.ckpt.commit.json``).
_RECORD_STEP = re.compile(r"(\d+)\D*\.commit\.json$")
_FRAMEWORK_ENV = {"PREEMPTION_GRACE_SECONDS": GRACE, "WORKER_TEST_PAUSE_BEFORE_COMMIT_SECONDS": SAVE_PAUSE,
                  "WORKER_TEST_STEP_DELAY_SECONDS": STEP_DELAY}

#: Per way in: the image; the module it needs and the worker extra installing it; the example
#: script, the integration to import before the test hooks, and the edits of its text (each must
#: be there once: the task folder as its output folder, fewer steps, fewer checkpoints); the
#: job's args and env; the run's steps and its checkpoint interval (steps). A framework's first
#: step after a commit reports its step (the pause before the record outlasts the worker's
#: one-second ``progress.json`` period); the own loop's checkpoints, about 2 s of steps apart,
#: outlast that period twice. Each run has one checkpoint interval to spare.
JOBS = {
    "own-loop": {"image": "test.local/own-loop:latest", "module": None,
                 "script": REPO / "examples" / "user-image" / "train.py", "edits": {}, "env": {},
                 "args": ["train", "--steps=350", "--checkpoint-every=50", "--step-delay=0.04",
                          "--preemption-save=never"], "steps": 350, "every": 50},
    "transformers": {"image": "test.local/transformers-trainer:latest", "module": ("transformers", "transformers"),
                     "script": EXAMPLES["transformers-trainer"], "args": [], "env": _FRAMEWORK_ENV,
                     "steps": 280, "every": 40,
                     "integration": "gpu_resilience_worker.integrations.transformers",
                     "edits": {'TrainingArguments("out", max_steps=300, save_steps=5,':
                               "TrainingArguments(task_namespace(), max_steps=280, save_steps=40,"}},
    "lightning": {"image": "test.local/lightning-fit:latest", "module": ("lightning", "lightning"),
                  "script": EXAMPLES["lightning-fit"], "args": [], "env": _FRAMEWORK_ENV,
                  "steps": 350, "every": 50,
                  "integration": "gpu_resilience_worker.integrations.lightning",
                  "edits": {'CommitCheckpoint("checkpoints", every_n_steps=5)':
                            "CommitCheckpoint(task_namespace(), every_n_steps=50)",
                            "max_steps=600,": "max_steps=350,"}},
}


def _job_script(job: dict, folder: Path) -> Path:
    """The job's script: the example itself, or a copy of it with its edits that first imports
    ``task_namespace``, the integration and then ``tests.worker.frameworks`` (its
    ``WORKER_TEST_PAUSE_BEFORE_COMMIT_SECONDS`` and ``WORKER_TEST_STEP_DELAY_SECONDS`` hooks)."""
    if not job["edits"]:
        return job["script"]
    source = job["script"].read_text()
    for old, new in job["edits"].items():
        assert source.count(old) == 1, f"{job['script']} no longer holds {old!r} once"
        source = source.replace(old, new)
    script = folder / job["script"].name
    script.write_text(f"from gpu_resilience_worker import task_namespace\nimport {job['integration']}\n"
                      f"import tests.worker.frameworks\n{source}")
    return script


def _image(job: dict, folder: Path) -> dict:
    """An image-table entry running the job's script with ``python`` in a scratch folder."""
    work = folder / "work"
    work.mkdir(exist_ok=True)
    return {"entrypoint": ["{python}", str(_job_script(job, folder))], "cwd": str(work),
            "env": {"PYTHONPATH": f"{REPO / 'worker'}{os.pathsep}{REPO}", "HF_HUB_OFFLINE": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
                    "PYTHONWARNINGS": "ignore", "OMP_WAIT_POLICY": "PASSIVE"}}


def newest_committed(task_folder: Path) -> int:
    """:return: the step of the newest commit record in ``task_folder`` (0 for none)."""
    names = [p.name for p in task_folder.iterdir()] if task_folder.is_dir() else []
    return max((int(m.group(1)) for n in names if (m := _RECORD_STEP.search(n))), default=0)


def _reported_step(task_folder: Path) -> int | None:
    """:return: ``progress.json``'s step while the worker reports ``running``, else ``None``."""
    try:
        progress = json.loads((task_folder / "progress.json").read_text())
    except (OSError, ValueError):
        return None
    step = progress.get("step")
    return step if progress.get("status") == "running" and isinstance(step, int) else None


def _past_a_newer_commit(task_folder: Path, every: int):
    """``ready`` for :func:`preempt_every_startup`: true once the task folder holds a commit
    newer than the newest one there when the execution was first asked about, and
    ``progress.json`` reports a step past that commit by at most half of the checkpoint
    interval (``every`` steps). So the stop comes after a step that is not committed (its
    resume computes steps again) and well before the next commit. The bound is inclusive: the
    own loop reports once a second, every 25 steps at its step delay, so its reports can fall on
    exactly half of its 50-step interval and on the commits, and never strictly between."""
    start: dict[str, int] = {}

    def ready(execution: str) -> bool:
        newest = newest_committed(task_folder)
        if newest <= start.setdefault(execution, newest):
            return False
        if not (task_folder / "progress.json").exists():
            return True  # a worker that reports no progress (the summary's checks then fail)
        reported = _reported_step(task_folder)
        return reported is not None and newest < reported <= newest + every // 2

    return ready


def _run_chain(way: str, tmp_path: Path, monkeypatch, job_name: str, transport: str) -> tuple[dict, list]:
    """Deploy the job of ``way`` and run it through :data:`PREEMPTIONS` preemptions to its end,
    talking to Cloud Run over ``transport``; check the attempts against the emulator's record of
    them.

    :return: ``(summary, executions oldest first)``.
    """
    job = JOBS[way]
    if job["module"]:
        require_module(*job["module"])
    with emulator_with_images(tmp_path, monkeypatch, {job["image"]: _image(job, tmp_path)}, transport) as emu:
        deploy(job_name, job["image"], job["args"], max_retries=0, env=job["env"])
        answers: list[dict] = []
        stop = threading.Event()
        ready = _past_a_newer_commit(bucket_dir(emu) / job_name / "task-0", job["every"])
        preempter = preempt_every_startup(emu, job_name, PREEMPTIONS, answers, stop, ready=ready)
        op = CloudRunGpuExecuteJobOperator(task_id="execute", job_name=job_name, region=REGION, deferrable=False,
                                           poll_interval=0.2, checkpoint_bucket=BUCKET, max_preemption_reruns=0)
        try:
            summary = op.execute({"ti": _TI()})
        finally:
            stop.set()
            preempter.join(timeout=30)
        assert len(answers) == PREEMPTIONS, answers
        found = executions(job_name)
        recorded = [a for e in found for a in emu.attempts(e.name)]
        assert [(a["stopReason"], a["exitCode"]) for a in recorded] == [("preempted", 143)] * PREEMPTIONS + [
            (None, 0)], recorded
        assert summary["goodput"]["tasks"][0]["gpu_seconds"] == pytest.approx(
            sum(a["seconds"] for a in recorded), rel=0.01)
        return summary, found


def _check_summary(summary: dict, found: list, total: int) -> None:
    """The chain, the attempts, the progress and the goodput account of a run of ``total`` steps."""
    chain = summary["chain"]
    short = [e.name.rsplit("/", 1)[-1] for e in found]
    assert [c["name"] for c in chain] == [e.name for e in found]
    assert [c["outcome"] for c in chain] == ["PREEMPTED"] * PREEMPTIONS + ["SUCCEEDED"], chain
    assert summary["outcome"] == "SUCCEEDED" and summary["reruns"] == PREEMPTIONS
    # each execution's progress: the committed step it started from rises, and each made progress
    assert chain[0]["start_steps"] == {} and all(c["progress"] is True for c in chain), chain
    for before, after in zip(chain, chain[1:]):
        assert before["end_steps"] == after["start_steps"], chain
        assert after["start_steps"]["0"] > (before["start_steps"] or {}).get("0", 0), chain
    assert chain[-1]["end_steps"] == {"0": total}, chain
    # the attempts Cloud Run ran, as the summary lists them; the worker's progress.json
    assert [(a["outcome"], a["exit_code"]) for a in summary["attempts"]] == (
        [("PREEMPTED", 143)] * PREEMPTIONS + [("SUCCEEDED", 0)]), summary["attempts"]
    progress = summary["progress"].get("0") or {}
    assert (progress.get("step"), progress.get("status")) == (total, "completed"), summary["progress"]
    # attempts.json: every resumed attempt lost the steps its predecessor did past the checkpoint
    # it resumed from (no stop saved)
    lost = summary["lost_work"]
    assert [(w["execution"], w["resumed_from_step"]) for w in lost] == [
        (name, c["start_steps"]["0"]) for name, c in zip(short[1:], chain[1:])], lost
    assert all(w["lost_steps"] > 0 for w in lost) and summary["lost_steps_total"] == sum(w["lost_steps"] for w in lost)
    # the goodput account, from the worker's events of every attempt
    [account] = summary["goodput"]["tasks"]
    rows = account["attempts"]
    assert [(r["execution"], r["times_from"]) for r in rows] == [(name, "platform") for name in short], rows
    assert (account["unknown_attempts"], account["inferred_attempts"]) == (0, 0), account
    assert all(r["reached_first_step"] and r["step_seconds"] > 0 and r["productive"] > 0 for r in rows), rows
    assert all(r["restore"] > 0 for r in rows[1:]), rows  # each resumed attempt loaded a checkpoint
    assert all(r["save_stall"] > 0 for r in rows), rows  # each attempt committed at least once
    # the steps each resumed attempt computed again are the steps lost, counted as wasted
    assert [r["steps_recomputed"] for r in rows] == [0] + [w["lost_steps"] for w in lost], (rows, lost)
    assert all(r["wasted"] > 0 for r in rows[1:]), rows
    assert sum(account[b] for b in BUCKETS) == pytest.approx(account["span_seconds"])
    assert "without worker events" not in summary["goodput"]["headline"], summary["goodput"]["headline"]


#: Every way in over gRPC (the clients' default transport); the own loop over REST too. What the
#: frameworks add is the worker side of the chain, which the transport does not reach, and their
#: chains are the slowest of the provider's tests.
CHAINS = [(way, "grpc") for way in JOBS] + [("own-loop", "rest")]


@pytest.mark.parametrize(("way", "transport"), CHAINS, indirect=["transport"])
def test_every_way_in_chains_through_preempted_executions_with_its_account(way, tmp_path, monkeypatch, job_name,
                                                                          transport):
    """A job of ``way`` through five preempted executions, each with progress, to SUCCEEDED."""
    summary, found = _run_chain(way, tmp_path, monkeypatch, job_name, transport)
    _check_summary(summary, found, JOBS[way]["steps"])
