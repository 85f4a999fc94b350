"""The checkpoint-manager example (``docs/examples/checkpoint_manager.py``) with DataLoader workers, as
a real process whose whole process group gets SIGTERM (as Cloud Run does to a container): it saves
and exits 143 within the grace period, persistent workers or not, and leaves no worker process
behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.worker.conftest import worker_env
from tests.worker.test_readme_example import _example

# serial (scripts/run_tests.sh runs it alone): a real worker process must exit within its grace period after SIGTERM.
pytestmark = pytest.mark.serial

GRACE_SECONDS = 10.0


def _script(tmp_path: Path, persistent: bool) -> Path:
    code = _example()
    assert "STEPS = 30\n" in code and "persistent_workers=True" in code
    code = code.replace("STEPS = 30\n", "STEPS = 10**9\n")
    code = code.replace("persistent_workers=True", f"persistent_workers={persistent}")
    path = tmp_path / "recipe.py"
    path.write_text(code)
    return path


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the example exited ({proc.returncode}) before {what}:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _newest_record(folder: Path) -> str:
    """:return: the name of the newest commit record in ``folder`` ('' when there is none)."""
    return max((p.name for p in folder.glob("ckpt-*.commit.json")), default="")


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per-epoch"])
def test_group_sigterm_saves_and_exits_143_with_dataloader_workers(tmp_path: Path, persistent: bool) -> None:
    script = _script(tmp_path, persistent)
    folder = tmp_path / "checkpoints" / "my-run"
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=worker_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        main = psutil.Process(proc.pid)
        # any record from step 20 on: the example keeps two checkpoints, so step 20's own record can
        # be gone (retention after step 40's save) before a poll sees it on a fast or busy machine
        _wait_for(lambda: _newest_record(folder) >= "ckpt-00000020.commit.json", 120, "step 20", proc)
        _wait_for(lambda: len(main.children()) >= 2, 30, "two DataLoader workers", proc)
        workers = main.children()
        signalled = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.fail(f"no exit within the {GRACE_SECONDS:.0f} s grace period (SIGKILL on Cloud Run)")
        output = proc.stdout.read()
        assert code == 143, output
        assert time.monotonic() - signalled < GRACE_SECONDS
        gone, alive = psutil.wait_procs(workers, timeout=5)
        assert not alive, f"DataLoader workers outlived the main process: {alive}"
        assert "Traceback" not in output, output
        records = sorted(p.name for p in folder.glob("*.commit.json"))
        assert len(records) == 2 and records[-1] >= "ckpt-00000020.commit.json", records
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
