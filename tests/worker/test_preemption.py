"""Real processes, real signals: SIGTERM and SIGKILL at chosen and random points, then resume.

The random test mixes ``--sync-save`` and (the default) ``--async-save`` attempts.

Every interrupted lineage must end with model and optimizer tensors bit-identical (same sha256)
to the uninterrupted baseline run.
"""

from __future__ import annotations

from datetime import datetime

import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.worker.conftest import SIGKILL, SIGTERM, Task, WorkerProcess

# serial (scripts/run_tests.sh runs it alone): real worker processes: exit 143 within the 10 s grace, a checkpoint before the task deadline.
pytestmark = pytest.mark.serial


def _hashes(metrics: dict) -> tuple[str, str]:
    return metrics["model_sha256"], metrics["optimizer_sha256"]


def _is(message: str):
    return lambda record: record.get("message") == message


def _started(record: dict) -> bool:
    return "resumed_from_step" in record


def test_sigkill_between_data_and_commit_resumes_from_previous(task: Task, baseline) -> None:
    pause = {"WORKER_TEST_PAUSE_BEFORE_COMMIT_SECONDS": "0.8"}
    first = task.start("--checkpoint-every", "20", env=pause)
    first.wait_for(lambda r: r.get("message") == "checkpoint data written" and r["step"] == 40)
    first.signal(SIGKILL)
    assert first.wait() == -SIGKILL
    assert (task.namespace / "ckpt-00000040.pt").exists()
    assert not (task.namespace / "ckpt-00000040.commit.json").exists()
    assert task.valid_steps() == [20]

    second = task.run("--checkpoint-every", "20")
    assert second.proc.returncode == 0, second.output
    assert any(r["message"] == "removed stale checkpoint file" and r["step"] == 40 for r in second.records)
    resumed = next(r for r in second.records if _started(r))
    assert resumed["message"] == "resuming from step 20" and resumed["resumed_from_step"] == 20
    metrics = task.metrics()
    assert metrics["history"][-1]["resumed_from_step"] == 20
    assert _hashes(metrics) == _hashes(baseline[0].metrics())


def test_sigterm_during_a_slow_restore_exits_143_without_waiting_for_it(task: Task) -> None:
    """A SIGTERM while a checkpoint is read ends the attempt with 143 after at most one more
    read, not after the whole restore (on a cold or slow volume, longer than the grace period);
    the checkpoint stays valid and the next attempt resumes from it."""
    # about 108 MB: 13 reads of 8 MiB; 40 steps (not 200), for the third attempt's sake
    flags = ("--hidden", "3000", "--checkpoint-every", "5", "--steps", "40")
    first = task.start(*flags)
    first.wait_for(lambda r: r.get("message") == "checkpoint saved" and r["step"] == 5, timeout=120)
    first.signal(SIGTERM)
    assert first.wait() == 143, first.output
    saved = task.valid_steps()[-1]
    # each read of the data file's second half takes 2 s: at least 12 s for the restore
    second = task.start(*flags, env={"WORKER_TEST_PAUSE_MID_READ_SECONDS": "2"})
    second.wait_for(lambda r: r.get("message") == "checkpoint data half read", timeout=120)
    signalled = time.monotonic()
    second.signal(SIGTERM)
    assert second.wait() == 143, second.output
    assert time.monotonic() - signalled < 8.0, second.output  # 2 s for the read under way, then out
    messages = [r["message"] for r in second.records]
    assert "SIGTERM received during the restore; exiting without it" in messages, messages
    assert not any(m.startswith(("resuming from step", "skipping invalid checkpoint", "checkpoint saved"))
                   for m in messages), messages
    assert task.valid_steps()[-1] == saved
    third = task.run(*flags)
    assert third.proc.returncode == 0, third.output
    assert any(r["message"] == f"resuming from step {saved}" for r in third.records), third.output


def test_process_group_sigterm_flushes_exits_143_and_resumes_bit_identical(task: Task, baseline) -> None:
    """Cloud Run signals the whole process group: the (async-saving) worker still flushes."""
    first = task.start("--checkpoint-every", "50", "--step-delay", "0.01", new_group=True)
    first.wait_for(lambda r: r.get("message") == "checkpoint saved" and r["step"] == 50)
    signalled = time.monotonic()
    first.signal_group(SIGTERM)
    assert first.wait() == 143, first.output
    assert time.monotonic() - signalled < 10.0  # PREEMPTION_GRACE_SECONDS
    stop = next(r for r in first.records if r["message"].startswith("SIGTERM received"))
    step = stop["step"]
    assert 50 <= step < 200
    assert step in task.valid_steps()
    assert first.records[-1]["exit_code"] == 143

    second = task.run("--checkpoint-every", "50")
    assert second.proc.returncode == 0, second.output
    assert any(r["message"] == f"resuming from step {step}" for r in second.records)
    metrics = task.metrics()
    assert [h["resumed_from_step"] for h in metrics["history"]] == [0, step]
    assert metrics["history"][-1]["lost_steps"] == 0
    assert _hashes(metrics) == _hashes(baseline[0].metrics())


def test_sigint_behaves_like_sigterm(task: Task, baseline) -> None:
    """Ctrl-C (SIGINT) is a stop request too: flush, exit 143, resume bit-identical."""
    first = task.start("--checkpoint-every", "50", "--step-delay", "0.01")
    first.wait_for(lambda r: r.get("message") == "checkpoint saved" and r["step"] == 50)
    signalled = time.monotonic()
    first.signal(signal.SIGINT)
    assert first.wait() == 143, first.output
    assert time.monotonic() - signalled < 10.0  # PREEMPTION_GRACE_SECONDS
    stop = next(r for r in first.records if r["message"].startswith("SIGINT received"))
    assert stop["severity"] == "WARNING" and stop["step"] in task.valid_steps()

    second = task.run("--checkpoint-every", "50")
    assert second.proc.returncode == 0, second.output
    assert any(r["message"] == f"resuming from step {stop['step']}" for r in second.records)
    assert task.metrics()["history"][-1]["lost_steps"] == 0
    assert _hashes(task.metrics()) == _hashes(baseline[0].metrics())


def test_no_checkpointing_strategy_saves_nothing_even_at_sigterm(task: Task) -> None:
    """Strategy (a) of the goodput benchmark: ``--checkpoint-every 0``, restart from zero."""
    process = task.start("--checkpoint-every", "0", "--step-delay", "0.01")
    process.wait_for(lambda r: r.get("message", "").startswith("progress: step"))
    process.signal(SIGTERM)
    assert process.wait() == 143, process.output
    assert any(r["message"].startswith("no checkpoint at the stop") for r in process.records)
    assert not list(task.namespace.glob("ckpt-*"))


def test_corrupt_newest_checkpoints_fall_back_with_warnings(baseline, task: Task) -> None:
    shutil.copytree(baseline[0].namespace, task.namespace)  # a finished run, keep 3
    assert task.valid_steps() == [160, 180, 200]
    (task.namespace / "metrics.json").unlink()
    newest = task.namespace / "ckpt-00000200.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
    second = task.namespace / "ckpt-00000180.pt"
    data = bytearray(second.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    second.write_bytes(bytes(data))

    resumed = task.run("--checkpoint-every", "20", "--keep", "3")
    assert resumed.proc.returncode == 0, resumed.output
    warned = [r["file"] for r in resumed.messages("WARNING") if r["message"] == "skipping invalid checkpoint"]
    assert [os.path.basename(f) for f in warned] == ["ckpt-00000200.pt", "ckpt-00000180.pt"]
    assert any(r["message"] == "resuming from step 160" for r in resumed.records)
    metrics = task.metrics()
    assert metrics["history"][-1]["lost_steps"] == 40
    assert _hashes(metrics) == _hashes(baseline[0].metrics())
    assert task.valid_steps() == [160, 180, 200]


def _interrupt(process: WorkerProcess, kind: str, rng: random.Random) -> bool:
    """Deliver one interruption of ``kind`` at a random point of the attempt.

    :return: whether it was delivered (``False`` when the attempt finished first).
    """
    awaited = {
        "kill-before-commit": _is("checkpoint data written"),
        "kill-mid-write": _is("checkpoint data half written"),
    }.get(kind, _started)
    if process.wait_for(awaited, allow_exit=True) is None:
        return False
    if kind in ("term", "kill"):
        time.sleep(rng.uniform(0.05, 0.4))
    process.signal(SIGTERM if kind == "term" else SIGKILL)
    return True


def _trail(attempts: list[tuple[str, WorkerProcess]]) -> str:
    """:return: what each attempt did, for a failure message: its kind and exit, its set-up
    (threads, MKL mode), where it resumed, what it saved and how it stopped (a failure that shows
    only the two digests leaves nothing to go on)."""
    keep = ("training setup", "checkpoint saved", "checkpoint data written", "exiting: interrupted, resumable",
            "training complete")
    lines = []
    for kind, process in attempts:
        lines.append(f"-- {kind}: exit {process.proc.returncode}")
        for record in process.records:
            message = str(record.get("message", ""))
            if message in keep or message.startswith(("resuming from", "using ", "SIGTERM", "no checkpoint found",
                                                      "skipping invalid", "--threads")):
                fields = {k: record[k] for k in ("step", "mode", "threads", "mkl_cbwr", "save_mode", "bytes")
                          if k in record}
                lines.append(f"   {message[:60]} {fields}")
    return "\n".join(lines)


def test_random_sigterm_and_sigkill_end_bit_identical(task: Task, baseline) -> None:
    rng = random.Random(1234)
    kinds = ["term", "kill-before-commit", "kill", "kill-mid-write", "term"]
    flags = ("--checkpoint-every", "15", "--step-delay", "0.01")
    pauses = {
        "kill-before-commit": {"WORKER_TEST_PAUSE_BEFORE_COMMIT_SECONDS": "0.8"},
        "kill-mid-write": {"WORKER_TEST_PAUSE_MID_WRITE_SECONDS": "0.8"},
    }
    newest_valid, interrupted = 0, 0
    attempts: list[tuple[str, WorkerProcess]] = []
    for index, kind in enumerate(kinds):
        mode = ("--async-save",) if index % 2 == 0 else ("--sync-save",)  # same checkpoint format
        process = task.start(*flags, *mode, env=pauses.get(kind))
        attempts.append((f"{kind} {mode[0]}", process))
        interrupted += _interrupt(process, kind, rng)
        code = process.wait()
        assert code in (0, 143 if kind == "term" else -SIGKILL), process.output
        valid = task.valid_steps()
        # The last good checkpoint never goes away, not even all of them at once (an empty list
        # must fail this too once a checkpoint was valid).
        assert (valid[-1] if valid else 0) >= newest_valid, valid
        newest_valid = valid[-1] if valid else 0
        if code == 0:
            break
    assert interrupted >= 4
    final = task.run("--checkpoint-interval", "auto", "--mtbi", "1", "--step-delay", "0.01")
    assert final.proc.returncode == 0, final.output
    assert any(r["message"].startswith("checkpoint interval:") for r in final.records)  # Young/Daly
    metrics = task.metrics()
    resumed = [h["resumed_from_step"] for h in metrics["history"]]
    assert resumed == sorted(resumed) and len(resumed) >= 3
    # attempts.json lists every attempt, also those killed before their first commit
    assert [a["attempt"] for a in metrics["attempts"]] == list(range(task.attempt))
    assert metrics["lost_steps_total"] == sum(a["lost_steps"] for a in metrics["attempts"])
    attempts.append(("final --checkpoint-interval auto", final))
    assert _hashes(metrics) == _hashes(baseline[0].metrics()), (
        f"history {metrics['history']}\n{_trail(attempts)}\nbaseline:\n{_trail([('baseline', baseline[1])])}")
    assert metrics["accuracy"] > 0.9


def test_final_save_skipped_when_it_does_not_fit_in_the_grace_period(task: Task) -> None:
    process = task.start("--checkpoint-every", "20", "--step-delay", "0.01",
                         env={"PREEMPTION_GRACE_SECONDS": "0.2"})
    process.wait_for(lambda r: r.get("message") == "checkpoint saved" and r["step"] == 20)
    time.sleep(0.1)  # a few steps past the checkpoint
    process.signal(SIGTERM)
    assert process.wait() == 143, process.output
    assert any(r["message"].startswith("final checkpoint skipped") for r in process.records)
    assert task.valid_steps()[-1] % 20 == 0  # only interval checkpoints


def test_task_timeout_checkpoints_and_exits_143_before_the_deadline(task: Task) -> None:
    process = task.run("--step-delay", "0.05", env={"TASK_TIMEOUT_SECONDS": "20"})
    assert process.proc.returncode == 143, process.output
    # The deadline counts from the worker's own start (its first log line), not from this test's
    # clock: interpreter and torch start-up under load must not make the check flaky.
    times = [datetime.fromisoformat(r["time"].replace("Z", "+00:00")) for r in process.records]
    assert (times[-1] - times[0]).total_seconds() < 20, process.output
    stop = next(r for r in process.records if r["message"].startswith("DEADLINE received"))
    assert stop["step"] in task.valid_steps()


def test_resuming_with_other_settings_exits_78(baseline, task: Task) -> None:
    shutil.copytree(baseline[0].namespace, task.namespace)
    (task.namespace / "metrics.json").unlink()
    process = task.run("--lr", "0.01")
    assert process.proc.returncode == 78, process.output
    assert "other settings" in (task.namespace / "FATAL").read_text()


def test_sigterm_during_start_up_exits_143_before_the_restore(capsys, monkeypatch, tmp_path: Path, digits_npz: Path) -> None:
    """A SIGTERM while the model is built (after the watcher is installed, before the first step)
    ends the attempt with 143 at once: no checkpoint is read, nothing is written but the goodput
    file. The real signal goes to this process; the CLI's watcher catches it."""
    import json
    import os
    import signal

    from gpu_resilience_trainer import __main__ as cli
    from gpu_resilience_trainer import train
    from gpu_resilience_worker import loop

    original = train.build_components

    def build_then_sigterm(*args, **kwargs):
        parts = original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return parts

    monkeypatch.setattr(train, "build_components", build_then_sigterm)
    restored = []
    monkeypatch.setattr(loop.ResilientLoop, "_resume", lambda self, *a: restored.append(a))
    argv = ["train", "--checkpoint-dir", str(tmp_path), "--data", str(digits_npz), "--steps", "50"]
    code = cli.main(argv, {"CLOUD_RUN_JOB": "job", "CLOUD_RUN_TASK_INDEX": "0", "CLOUD_RUN_TASK_COUNT": "1"})
    messages = [json.loads(line)["message"] for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert code == 143, messages
    assert "SIGTERM received during start-up; exiting before the restore" in messages
    assert restored == [] and not list((tmp_path / "job" / "task-0").glob("ckpt-*")), "nothing restored or saved"
