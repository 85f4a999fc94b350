"""The fork guard: an ``os.fork()`` waits while a file is open for writing, so that no child's
close can finalize it early on Cloud Storage FUSE (see :mod:`gpu_resilience_worker.forkguard`);
and, on the emulator's strict FUSE volume, a background save beside a forking training loop
stays one streamed upload."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from gpu_resilience_worker import forkguard
from gpu_resilience_worker.checkpoint import AsyncMode, CheckpointConfig, CheckpointManager
from gpu_resilience_worker.logs import StructuredLogger
from tests.conftest import require_fuse


def _fork_and_reap() -> int:
    """Fork a child that exits at once (as a short-lived worker process would) and reap it.
    :return: the child's exit status."""
    pid = os.fork()
    if pid == 0:
        os._exit(7 if forkguard.open_writes() else 0)  # the child has no writes of its own
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_fork_in_another_thread_waits_until_the_open_write_ends() -> None:
    entered, release, left = threading.Event(), threading.Event(), threading.Event()

    def writer() -> None:
        with forkguard.writing():
            entered.set()
            release.wait(10)
        left.set()

    thread = threading.Thread(target=writer)
    thread.start()
    assert entered.wait(10) and forkguard.open_writes() == 1
    threading.Timer(0.3, release.set).start()
    started = time.monotonic()
    assert _fork_and_reap() == 0  # and the child saw no open writes
    assert left.is_set(), "the fork went ahead while the file was still open"
    assert time.monotonic() - started >= 0.25
    thread.join(10)
    assert forkguard.open_writes() == 0


def test_the_writing_thread_may_fork_itself_and_writes_nest() -> None:
    with forkguard.writing(), forkguard.writing():
        assert forkguard.open_writes() == 2
        assert _fork_and_reap() == 0  # no wait for itself (it would never end)
    assert forkguard.open_writes() == 0
    assert _fork_and_reap() == 0  # and later forks do not wait at all


def test_a_write_that_fails_is_no_longer_open() -> None:
    with pytest.raises(OSError):
        with forkguard.writing():
            raise OSError("disk full")
    assert forkguard.open_writes() == 0


class _Bag:
    def __init__(self, size_mib: int) -> None:
        self.tensor = torch.arange(size_mib << 18, dtype=torch.float32)

    def state_dict(self) -> dict:
        return {"tensor": self.tensor}

    def load_state_dict(self, state: dict) -> None:
        self.tensor.copy_(state["tensor"])


@pytest.fixture
def strict_volume(tmp_path: Path):
    """A strict-mode FUSE volume of the emulator (staging is an ``EIO``)."""
    require_fuse()
    from airflow_gpu_resilience.emulator.gcsfuse import GcsFuseMount

    with GcsFuseMount(tmp_path / "bucket", tmp_path / "mnt", tmp_path / "state", strict=True) as mount:
        yield mount, tmp_path / "bucket"


def test_a_loop_that_forks_during_a_background_save_leaves_it_one_streamed_upload(strict_volume) -> None:
    """A training loop starting short-lived worker processes (``os.fork``) while the background
    save writes: each fork waits for the open file, so no child's exit finalizes it early; the
    save completes, streamed, and restores."""
    volume, bucket = strict_volume
    bag = _Bag(64)
    folder = volume.mountpoint / "run"
    config = CheckpointConfig(folder=str(folder), interval=1, keep_latest_k=2, async_mode=AsyncMode.ASYNC)
    forks_during_save = 0
    with CheckpointManager(config, {"bag": bag}, logger=StructuredLogger(open(os.devnull, "w"))) as manager:
        for step in (1, 2, 3):
            bag.tensor.add_(1.0)
            manager.save(step)
            data = f"ckpt-{step:08d}.pt"
            deadline = time.monotonic() + 30
            while not (folder / data).exists() and time.monotonic() < deadline:
                time.sleep(0.001)  # until the background save has its data file open on the mount
            if (folder / data).exists() and not (bucket / "run" / data).exists():  # not uploaded yet
                forks_during_save += 1
            assert _fork_and_reap() == 0
        manager.wait_until_finished()  # raises CheckpointSaveError had a write failed
        assert manager.valid_steps()[0] == 3
    assert forks_during_save >= 1, "no fork met an open write: the test did not test the guard"
    events = [e for e in volume.events() if e["kind"] in ("staged", "estale")]
    assert events == []
    restored = _Bag(64)
    with CheckpointManager(CheckpointConfig(folder=str(folder), interval=0), {"bag": restored},
                           logger=StructuredLogger(open(os.devnull, "w"))) as manager:
        assert manager.load()
    assert torch.equal(restored.tensor, bag.tensor)
