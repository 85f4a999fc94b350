"""An exception in the training step ends the attempt as ``failed`` for every way in, in real
processes: ``transformers.Trainer`` (its ``train()`` raises out of the user's script),
Lightning (``fit`` raises) and an own loop (``ResilientLoop.run`` returns 1). The goodput events
file says ``failed`` with exit 1 and the steps done; no ``metrics.json`` is written.

Each process runs a way in's example with a global optimizer-step hook that raises at step
``FAIL_AFTER_STEPS + 1``. Cost: about 30 s on 2 cores (each process imports torch, two a framework).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import require_module
from tests.worker.conftest import REPO_ROOT, worker_env
from tests.worker.frameworks import EXAMPLES

#: Runs ``sys.argv[1]`` as ``__main__`` with every optimizer step after the ``FAIL_AFTER_STEPS``-th raising.
LAUNCH = """
import os, runpy, sys
from torch.optim.optimizer import register_optimizer_step_pre_hook
done = [0]
def fail(optimizer, args, kwargs):
    done[0] += 1
    if done[0] > int(os.environ["FAIL_AFTER_STEPS"]):
        raise RuntimeError("a bug in the training step")
register_optimizer_step_pre_hook(fail)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
STEPS = 7


def _fail(script: Path, cwd: Path, folder: Path, *args: str) -> None:
    env = worker_env(CLOUD_RUN_JOB="job", CLOUD_RUN_EXECUTION="job-x", CLOUD_RUN_TASK_ATTEMPT="0",
                     CHECKPOINT_DIR=str(cwd), FAIL_AFTER_STEPS=str(STEPS), PYTHONWARNINGS="ignore",
                     HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    result = subprocess.run([sys.executable, "-c", LAUNCH, str(script), *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    events = json.loads((folder / "goodput-job-x-0.json").read_text())
    assert (events["status"], events["exit_code"], events["steps"]) == ("failed", 1, STEPS), events
    assert [a["attempt"] for a in json.loads((folder / "attempts.json").read_text())["attempts"]] == [0]
    assert not (folder / "metrics.json").exists()


def test_an_exception_in_trainer_train_ends_the_attempt_failed(tmp_path: Path) -> None:
    require_module("transformers", extra="transformers")
    _fail(EXAMPLES["transformers-trainer"], tmp_path, tmp_path / "out")


def test_an_exception_in_lightning_fit_ends_the_attempt_failed(tmp_path: Path) -> None:
    require_module("lightning", extra="lightning")
    _fail(EXAMPLES["lightning-fit"], tmp_path, tmp_path / "checkpoints")


def test_an_exception_in_an_own_loop_ends_the_attempt_failed(tmp_path: Path) -> None:
    _fail(REPO_ROOT / "examples" / "user-image" / "train.py", tmp_path, tmp_path / "job" / "task-0",
          "--steps=60", "--checkpoint-every=5")
