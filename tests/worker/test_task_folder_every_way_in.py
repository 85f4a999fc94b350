"""Every way in leaves the same task-folder files: an attempt stopped by SIGTERM and one resumed
to the end, in real processes, leave ``progress.json`` (``completed`` at the last step), ``metrics.json``,
``attempts.json`` (both attempts; the second resumed from the newest commit, nothing lost) and one
goodput events file per attempt (``preempted`` with its restore, first step, steps and save stall,
then ``completed``), for ``transformers.Trainer`` (``CommitCallback``), Lightning
(``CommitCheckpoint``) and an own loop (``ResilientLoop``, the user-image example).

Cost: about 40 s on 2 cores (two fork servers importing a framework once, two short script runs).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.conftest import require_module
from tests.worker.frameworks import ForkServer, log_records, readme_block, wait_for
from tests.worker.test_resilient_loop import FLAGS, ScriptProcess, _saved

# serial (scripts/run_tests.sh runs it alone): real processes must exit 143 within the grace period after SIGTERM.
pytestmark = pytest.mark.serial

EXECUTION = "job-x"


def _check_folder(folder: Path, total: int, resumed_from: int, execution: str = EXECUTION) -> None:
    progress = json.loads((folder / "progress.json").read_text())
    assert (progress["status"], progress["step"], progress["total_steps"]) == ("completed", total, total)
    attempts = json.loads((folder / "attempts.json").read_text())["attempts"]
    assert [(a["execution"], a["attempt"], a["resumed_from_step"], a["lost_steps"]) for a in attempts] == [
        (execution, 0, 0, 0), (execution, 1, resumed_from, 0)], attempts
    first = json.loads((folder / f"goodput-{execution}-0.json").read_text())
    second = json.loads((folder / f"goodput-{execution}-1.json").read_text())
    assert (first["status"], first["exit_code"], second["status"], second["exit_code"]) == (
        "preempted", 143, "completed", 0)
    for events, start in ((first, 0), (second, resumed_from)):
        assert events["resumed_from_step"] == start
        assert events["restore_start"] <= events["restore_end"] <= events["first_step_at"] <= events["ended_at"]
        assert events["saves"] >= 1 and events["save_blocking_seconds"] > 0
    assert first["steps"] == resumed_from and second["steps"] == total - resumed_from
    metrics = json.loads((folder / "metrics.json").read_text())
    assert (metrics["steps"], metrics["total_steps"], [a["attempt"] for a in metrics["attempts"]]) == (total, total, [0, 1])


def _framework_chain(tmp_path: Path, *, block: str, modules: list[str], folder: str, total: int) -> None:
    script = tmp_path / "job.py"
    script.write_text(readme_block(block))
    with ForkServer(modules) as server:
        log = tmp_path / "attempt-0.log"
        pid, _ = server.start(script, tmp_path, log, CLOUD_RUN_EXECUTION=EXECUTION, CLOUD_RUN_TASK_ATTEMPT="0",
                              WORKER_TEST_STEP_DELAY_SECONDS="0.03")
        assert wait_for(log, "checkpoint committed", server) is not None, log.read_text()[-3000:]
        os.kill(pid, signal.SIGTERM)  # a preemption
        status, _ = server.wait()
        assert status == 143, log.read_text()[-3000:]
        [stop] = [r for r in log_records(log) if r["message"] == "preempted: exiting"]
        second = tmp_path / "attempt-1.log"
        server.start(script, tmp_path, second, CLOUD_RUN_EXECUTION=EXECUTION, CLOUD_RUN_TASK_ATTEMPT="1")
        status, _ = server.wait()
        assert status == 0, second.read_text()[-3000:]
    _check_folder(tmp_path / folder, total, stop["last_committed"])
    assert stop["step"] == stop["last_committed"], stop  # the stop saved its step: nothing lost


def test_transformers_trainer_leaves_the_task_folder_files(tmp_path: Path) -> None:
    require_module("transformers", extra="transformers")
    _framework_chain(tmp_path, block="transformers-trainer", folder="out", total=300,
                     modules=["transformers", "transformers.models.gpt2.modeling_gpt2", "transformers.trainer",
                              "gpu_resilience_worker.integrations.transformers"])


def test_lightning_fit_leaves_the_task_folder_files(tmp_path: Path) -> None:
    require_module("lightning", extra="lightning")
    _framework_chain(tmp_path, block="lightning-fit", folder="checkpoints", total=600,
                     modules=["lightning", "lightning.pytorch", "gpu_resilience_worker.integrations.lightning",
                              "?gcsfs", "?s3fs", "?adlfs"])


def test_own_loop_leaves_the_task_folder_files(tmp_path: Path) -> None:
    root = tmp_path / "run"
    first = ScriptProcess(root, *FLAGS, attempt=0)
    first.wait_for(_saved(20), timeout=60)
    first.signal(signal.SIGTERM)
    assert first.wait(timeout=15) == 143, first.output
    [stop] = [r for r in first.records if r.get("message") == "exiting: interrupted, resumable"]
    assert stop["step"] == stop["last_checkpoint_step"], stop
    second = ScriptProcess(root, *FLAGS, attempt=1)
    assert second.wait(timeout=120) == 0, second.output
    _check_folder(root / "own-loop" / "task-0", 60, stop["step"], execution="own-loop-1")
