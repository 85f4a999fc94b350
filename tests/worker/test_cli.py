"""Real worker processes: a clean run, the completed-run shortcut, and non-retryable errors.

More bad-input cases run in-process in ``test_bad_input_inprocess.py``."""

from __future__ import annotations

import json
import os

import pytest

from tests.worker.conftest import Task, WorkerProcess


def test_uninterrupted_run_succeeds(baseline: tuple[Task, WorkerProcess]) -> None:
    task, process = baseline
    assert process.proc.returncode == 0, process.output
    metrics = task.metrics()
    assert metrics["accuracy"] > 0.9
    assert metrics["steps"] == metrics["total_steps"] == 200
    assert metrics["checkpoints_written"] == 10
    assert metrics["history"] == [
        {"execution": "job-exec", "attempt": 0, "task_index": 0, "resumed_from_step": 0, "lost_steps": 0}
    ]
    assert [a["attempt"] for a in metrics["attempts"]] == [0] and metrics["lost_steps_total"] == 0
    assert len(metrics["model_sha256"]) == len(metrics["optimizer_sha256"]) == 64
    assert task.valid_steps() == [160, 180, 200]  # keep 3
    progress = json.loads((task.namespace / "progress.json").read_text())
    assert progress["status"] == "completed" and progress["step"] == 200
    assert set(progress) >= {"step", "total_steps", "status", "updated_at", "loss", "steps_per_second"}
    messages = [r["message"] for r in process.records]
    assert all("severity" in r for r in process.records)
    assert any(m.startswith("no checkpoint found") for m in messages)
    assert "checkpoint saved" in messages and "training complete" in messages
    saved = next(r for r in process.records if r["message"] == "checkpoint saved")
    assert {"step", "bytes", "seconds"} <= set(saved)
    assert any("eta_seconds" in r for r in process.records)
    setup = next(r for r in process.records if r["message"] == "training setup")
    for field, name, default in (("mkl_cbwr", "MKL_CBWR", "AUTO,STRICT"), ("mkl_dynamic", "MKL_DYNAMIC", "FALSE"),
                                 ("omp_dynamic", "OMP_DYNAMIC", "FALSE")):
        assert setup[field] == os.environ.get(name, default), setup  # oneMKL's reproducibility conditions


def test_the_user_s_own_mkl_and_openmp_settings_are_kept(task: Task) -> None:
    process = task.run("--steps", "2", env={"MKL_DYNAMIC": "TRUE", "OMP_DYNAMIC": "true", "MKL_CBWR": "COMPATIBLE"})
    assert process.proc.returncode == 0, process.output
    setup = next(r for r in process.records if r["message"] == "training setup")
    assert (setup["mkl_cbwr"], setup["mkl_dynamic"], setup["omp_dynamic"]) == ("COMPATIBLE", "TRUE", "true")


def test_completed_run_exits_at_once(baseline: tuple[Task, WorkerProcess]) -> None:
    task, _ = baseline
    before = task.metrics()
    process = task.run("--checkpoint-every", "20", "--keep", "3")
    assert process.proc.returncode == 0, process.output
    assert any("already complete" in r["message"] for r in process.records)
    assert not any(r["message"].startswith(("resuming", "checkpoint saved")) for r in process.records)
    assert task.metrics() == before


@pytest.mark.parametrize(("args", "env", "reason"), [(["--keep", "1"], {}, "in flight")])
def test_bad_config_exits_78_and_later_attempts_exit_at_once(task: Task, args, env, reason: str) -> None:
    first = task.run(*args, env=env)
    assert first.proc.returncode == 78, first.output
    fatal = json.loads((task.namespace / "FATAL").read_text())
    assert fatal["exit_code"] == 78 and reason in fatal["reason"]
    second = task.run(*args, env=env)  # a Cloud Run retry of the same task stops at once
    assert second.proc.returncode == 78, second.output
    assert [r["severity"] for r in second.records] == ["ERROR"]  # one line, no training
    assert not list(task.namespace.glob("ckpt-*"))


def test_bad_task_index_exits_78(task: Task) -> None:
    process = task.run(env={"CLOUD_RUN_TASK_INDEX": "abc"})
    assert process.proc.returncode == 78
    assert any("CLOUD_RUN_TASK_INDEX" in r["message"] for r in process.records)


@pytest.mark.parametrize(("args", "env", "code"), [
    (["--keep", "1"], {}, 78),  # a flag: the configuration fails before the marker is looked at
    ([], {"PREEMPTION_GRACE_SECONDS": "inf"}, 78),  # the environment: the same
    (["--data", "missing.npz"], {}, 65),  # valid configuration, bad input: the marker is obeyed
], ids=["78-flag", "78-environment", "65-missing-data"])
def test_a_retry_obeys_its_fatal_marker_without_rewriting_it(task: Task, args, env, code: int) -> None:
    """``FATAL`` is written once: on a Cloud Storage FUSE volume each rewrite is a mutation of
    the same object name (throttled within a second). A 78 rewrote it on every retry."""
    first = task.run(*args, env=env)
    assert first.proc.returncode == code, first.output
    marker = task.namespace / "FATAL"
    before = marker.stat()
    content = marker.read_bytes()
    assert json.loads(content)["exit_code"] == code
    second = task.run(*args, env=env)  # a Cloud Run retry: same arguments, next attempt
    assert second.proc.returncode == code, second.output
    after = marker.stat()
    assert (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino)
    assert marker.read_bytes() == content
    errors = second.messages("ERROR")
    assert [r["severity"] for r in second.records] == ["ERROR"] and errors[0]["exit_code"] == code


def test_a_78_with_another_reason_or_other_arguments_rewrites_the_marker(task: Task) -> None:
    """Only the same error of the same invocation keeps the marker: a changed environment (same
    arguments, another bad value) or other arguments record their own error."""
    marker = task.namespace / "FATAL"
    assert task.run(env={"PREEMPTION_GRACE_SECONDS": "inf"}).proc.returncode == 78
    assert "PREEMPTION_GRACE_SECONDS" in json.loads(marker.read_text())["reason"]
    second = task.run(env={"TASK_TIMEOUT_SECONDS": "0"})
    assert second.proc.returncode == 78
    assert "TASK_TIMEOUT_SECONDS" in json.loads(marker.read_text())["reason"]
    assert "fatal_marker_kept" not in second.messages("ERROR")[0]
    third = task.run("--keep", "1", env={"TASK_TIMEOUT_SECONDS": "0"})
    recorded = json.loads(marker.read_text())
    assert third.proc.returncode == 78 and "--keep" in recorded["invocation"]["argv"]
