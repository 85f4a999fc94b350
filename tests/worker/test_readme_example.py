"""The documentation's worker examples run as written (``docs/examples/``, included by the "Your
training code" page): the checkpoint manager, the bundled worker's command line and the own loop."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpu_resilience_worker.preemption import ignore_termination_signals

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "docs" / "examples"
#: The example files, by the names the tests use.
FILES = {"checkpoint-manager": "checkpoint_manager.py", "own-loop": "own_loop.py",
         "bundled-worker": "bundled_worker.sh"}


def _example() -> str:
    """The checkpoint-manager example's source."""
    return (EXAMPLES / FILES["checkpoint-manager"]).read_text()


def test_readme_checkpoint_manager_example_runs_and_resumes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = compile(_example(), str(EXAMPLES / FILES["checkpoint-manager"]), "exec")
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
        cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True,
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


def _root_example(name: str, language: str) -> str:
    """An example file's source: the whole script, or a shell file's lines that are not comments.

    :param name: ``own-loop`` or ``bundled-worker``.
    :param language: ``python`` or ``sh``.
    """
    text = (EXAMPLES / FILES[name]).read_text()
    if language == "sh":
        return "\n".join(line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    return text


def test_readme_own_loop_example_runs_and_resumes(tmp_path: Path) -> None:
    """The own-loop example, as a script: trains 100 steps, then a rerun resumes at 100.
    Cost: about 8 s (two processes importing torch)."""
    from tests.worker.conftest import worker_env

    script = tmp_path / "own_loop.py"
    script.write_text(_root_example("own-loop", "python"))
    first = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=worker_env(), capture_output=True,
                           text=True, timeout=120)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    metrics = json.loads((tmp_path / "checkpoints" / "own-loop" / "metrics.json").read_text())
    assert metrics["steps"] == 100 and metrics["final_weight_norm"] > 0
    again = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=worker_env(), capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0 and '"resuming from step 100"' in again.stdout, again.stdout[-3000:]


def test_readme_bundled_worker_example_runs(tmp_path: Path, digits_npz: Path) -> None:
    """The bundled worker's command line, with the data where it says. Cost: about 5 s."""
    from tests.worker.conftest import worker_env

    [line] = [line for line in _root_example("bundled-worker", "sh").splitlines() if line.strip()]
    argv = shlex.split(line)
    assert argv[:3] == ["python", "-m", "gpu_resilience_trainer"]
    (tmp_path / "checkpoints").mkdir()
    shutil.copyfile(digits_npz, tmp_path / "checkpoints" / "digits.npz")
    result = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, env=worker_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [metrics] = (tmp_path / "checkpoints").glob("*/task-0/metrics.json")
    assert json.loads(metrics.read_text())["steps"] == 40
