"""The checkpoint-manager example in worker/README.md runs as written, and resumes."""

from __future__ import annotations

import re
import signal
from pathlib import Path

from worker.preemption import ignore_termination_signals

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


def test_ignore_termination_signals_for_dataloader_workers() -> None:
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        ignore_termination_signals(0)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
