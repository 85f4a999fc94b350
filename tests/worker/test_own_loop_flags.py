"""The documentation's own-loop example (``docs/examples/own_loop.py``) as Cloud Run runs it: a bad
flag is a configuration error (``FATAL``, exit 78: the execute operator fails the task without
retry) rather than argparse's exit 2 (retried as FAILED), and with ``CLOUD_RUN_JOB`` set it trains
in the default task folder, the one the execute operator reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.worker.conftest import worker_env

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "own_loop.py"


def _run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=tmp_path, env=worker_env(**env),
                          capture_output=True, text=True, timeout=120)


def test_a_bad_flag_writes_fatal_and_exits_78(tmp_path: Path) -> None:
    run = _run(tmp_path, "--steps=many")
    assert run.returncode == 78, run.stdout[-2000:] + run.stderr[-2000:]
    marker = json.loads((tmp_path / "checkpoints" / "own-loop" / "FATAL").read_text())
    assert marker["exit_code"] == 78 and marker["reason"].startswith("invalid arguments: argument --steps"), marker


def test_on_cloud_run_it_trains_in_the_default_task_folder(tmp_path: Path) -> None:
    run = _run(tmp_path, "--steps=20", CHECKPOINT_DIR=str(tmp_path / "bucket"), CLOUD_RUN_JOB="my-job",
               CHECKPOINT_RUN_ID="run-2", CLOUD_RUN_TASK_INDEX="0", CLOUD_RUN_TASK_COUNT="1")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    metrics = json.loads((tmp_path / "bucket" / "my-job" / "run-2" / "task-0" / "metrics.json").read_text())
    assert metrics["steps"] == 20
    assert not (tmp_path / "checkpoints").exists()
