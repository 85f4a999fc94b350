"""The checkpoint-manager example in worker/README.md runs as written, and resumes."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpu_resilience_worker.preemption import ignore_termination_signals

README = Path(__file__).resolve().parents[2] / "worker" / "README.md"


def _example() -> str:
    text = README.read_text()
    match = re.search(r"<!-- example: checkpoint-manager.*?-->\s*```python\n(.*?)```", text, re.S)
    assert match, "the example block is missing from worker/README.md"
    return match.group(1)


def test_readme_checkpoint_manager_example_runs_and_resumes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = compile(_example(), str(README), "exec")
    exec(code, {"__name__": "readme_example"})
    folder = tmp_path / "checkpoints" / "my-run"
    assert sorted(p.name for p in folder.glob("*.commit.json")) == [
        "ckpt-00000020.commit.json", "ckpt-00000030.commit.json",
    ]
    namespace: dict = {"__name__": "readme_example"}
    exec(code, namespace)  # a second run loads step 30 and has nothing left to do
    assert namespace["progress"].step == 30


def test_ignore_termination_signals_ignores_others_but_not_the_parent(tmp_path: Path) -> None:
    """A process that called it survives SIGTERM and SIGINT from a stranger (here, a signal to
    its process group), and exits 0 at once on a SIGTERM from its parent."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from gpu_resilience_worker.preemption import ignore_termination_signals\n"
         "ignore_termination_signals(0)\nprint('ready', flush=True)\ntime.sleep(60)\n"],
        cwd=README.parents[1], stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        stranger = subprocess.run(  # a sibling, not the parent, signals the group
            [sys.executable, "-c", f"import os, signal; os.killpg({child.pid}, signal.SIGTERM); "
             f"os.killpg({child.pid}, signal.SIGINT)"], check=True)
        assert stranger.returncode == 0
        time.sleep(0.5)
        assert child.poll() is None, "the signal from a stranger ended the process"
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=5) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
