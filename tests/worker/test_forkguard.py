"""The private descriptor table of a write: no child process, however it starts, holds a file
being written, so none can finalize it early on Cloud Storage FUSE (see
:mod:`gpu_resilience_worker.forkguard`); on the emulator's strict FUSE volume, a background save
beside a forking training loop stays one streamed upload."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
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
    :return: the child's exit status (0)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _refuse_unshare(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make ``unshare(CLONE_FILES)`` refused (``EPERM``, as under Docker's default seccomp profile).
    :return: a list that grows by one at each try."""
    calls: list[int] = []
    monkeypatch.setattr(forkguard, "_private_refused", None)
    monkeypatch.setattr(forkguard, "_unshare_files", lambda: calls.append(1) or errno.EPERM)
    return calls


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
    from cloud_run_emulator.gcsfuse import GcsFuseMount

    with GcsFuseMount(tmp_path / "bucket", tmp_path / "mnt", tmp_path / "state", strict=True) as mount:
        yield mount, tmp_path / "bucket"


def test_a_loop_that_forks_during_a_background_save_leaves_it_one_streamed_upload(strict_volume) -> None:
    """A training loop starting short-lived worker processes (``os.fork``) while the background
    save writes: no child holds the open file (it is in the write's own table), so no child's exit
    finalizes it early; the save completes, streamed, and restores."""
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


# -- write_privately: the file in a descriptor table of its own --------------------------------

def _write_with_pause(storage_path: Path, opened: threading.Event, resume: threading.Event,
                      outcome: dict) -> threading.Thread:
    """Write 8 MiB to ``storage_path`` through ``LocalStorage.write`` on a background thread (as a
    background save does), pausing with the file open and half written until ``resume``."""
    from gpu_resilience_worker.storage import LocalStorage

    def produce(handle) -> None:
        handle.write(b"a" * (4 << 20))
        outcome["fd"] = handle.fileno()
        outcome["tid"] = threading.get_native_id()
        opened.set()
        assert resume.wait(30)
        handle.write(b"b" * (4 << 20))

    def run() -> None:
        try:
            LocalStorage().write(str(storage_path), produce)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    assert opened.wait(30)
    return thread


def _start_child(how: str) -> None:
    """Start a short-lived child process ``how`` (``subprocess``, or a ``multiprocessing`` start
    method) and wait for its end."""
    if how == "subprocess":
        subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)
        return
    import multiprocessing

    process = multiprocessing.get_context(how).Process(target=os.getpid)
    process.start()
    process.join(60)
    assert process.exitcode == 0


@pytest.mark.parametrize("how", ["subprocess", "spawn", "forkserver", "fork"])
def test_a_child_started_any_way_during_a_write_never_finalizes_it(strict_volume, how: str) -> None:
    """A child process started while a file is half written on the strict FUSE volume, by
    ``subprocess``, ``spawn``, ``forkserver`` or ``fork``: the file is in no table the child
    copies, so its exit flushes nothing, no fork waits, and the write ends as one streamed upload.
    (Before ``write_privately``, the ``exec`` of the first three closed an inherited copy: the
    object was finalized half written and the second half was an ``EIO``.)"""
    volume, bucket = strict_volume
    target = volume.mountpoint / "run" / "ckpt-00000001.pt"
    opened, resume, outcome = threading.Event(), threading.Event(), {}
    thread = _write_with_pause(target, opened, resume, outcome)
    try:
        assert not os.path.exists(f"/proc/self/fd/{outcome['fd']}") or \
            os.readlink(f"/proc/self/fd/{outcome['fd']}") != str(target)  # not in the process's table
        assert os.readlink(f"/proc/self/task/{outcome['tid']}/fd/{outcome['fd']}") == str(target)
        started = time.monotonic()
        _start_child(how)
        assert time.monotonic() - started < 30  # went ahead: no fork waits for a private write
        assert not (bucket / "run" / "ckpt-00000001.pt").exists()  # nothing was finalized early
    finally:
        resume.set()
        thread.join(60)
    assert "error" not in outcome, outcome.get("error")
    assert (bucket / "run" / "ckpt-00000001.pt").read_bytes() == b"a" * (4 << 20) + b"b" * (4 << 20)
    assert [e for e in volume.events() if e["kind"] in ("staged", "estale")] == []


def test_where_unshare_is_refused_a_subprocess_during_a_write_finalizes_it_early(
        strict_volume, monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented limit where ``unshare`` is refused, shown so that the test above is known to
    test something: a ``subprocess`` started during the write finalizes the half written object,
    and the rest of the write is an ``EIO`` on the strict volume."""
    _refuse_unshare(monkeypatch)
    volume, _ = strict_volume
    opened, resume, outcome = threading.Event(), threading.Event(), {}
    thread = _write_with_pause(volume.mountpoint / "run" / "ckpt-00000001.pt", opened, resume, outcome)
    try:
        _start_child("subprocess")
    finally:
        resume.set()
        thread.join(60)
    assert isinstance(outcome.get("error"), OSError), outcome
    assert [e["kind"] for e in volume.events() if e["kind"] == "staged"] == ["staged"]


def test_write_privately_returns_raises_and_nests() -> None:
    seen = []

    def inner() -> str:
        seen.append((threading.get_native_id(), forkguard.in_private_files()))
        return "inner"

    def outer() -> str:
        seen.append((threading.get_native_id(), forkguard.in_private_files()))
        return forkguard.write_privately(inner) + "+outer"

    assert forkguard.write_privately(outer) == "inner+outer"
    assert seen[0] == seen[1] and seen[0][1] is True  # nested: the same private thread, no new one
    assert seen[0][0] != threading.get_native_id()
    assert not forkguard.in_private_files()
    with pytest.raises(ZeroDivisionError):
        forkguard.write_privately(lambda: 1 / 0)


def test_a_refused_unshare_writes_in_the_caller_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Where ``unshare(CLONE_FILES)`` is refused (a sandbox), every write still completes, in the
    calling thread; the refusal is remembered (later writes do not try again) and warned about
    once."""
    from gpu_resilience_worker.storage import LocalStorage

    calls = _refuse_unshare(monkeypatch)
    threads = []

    def produce(handle) -> None:
        threads.append((threading.get_native_id(), forkguard.in_private_files()))
        handle.write(b"x" * 1000)

    with caplog.at_level(logging.WARNING, logger=forkguard.__name__):
        for name in ("one.bin", "two.bin"):
            LocalStorage().write(str(tmp_path / name), produce)
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes() == b"x" * 1000
    assert threads == [(threading.get_native_id(), False)] * 2
    assert forkguard.private_files_refused() == errno.EPERM
    assert calls == [1]
    warned = [r for r in caplog.records if r.name == forkguard.__name__ and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "unshare(CLONE_FILES) refused (EPERM)" in warned[0].getMessage()


def test_the_hash_threads_share_the_process_table_after_a_private_write(tmp_path: Path) -> None:
    """The digest threads start before the private write, from its caller: none shares (and keeps
    alive) a write's own descriptor table."""
    from gpu_resilience_worker.fastio import HashingWriter
    from gpu_resilience_worker.storage import LocalStorage

    def produce(handle) -> None:
        writer = HashingWriter(handle)
        writer.write(bytes(4 << 20))
        writer.digests()

    LocalStorage().write(str(tmp_path / "data.bin"), produce)
    hashers = [t for t in threading.enumerate() if t.name.startswith("sha256")]
    assert hashers
    with open(tmp_path / "later.txt", "w") as handle:  # opened in the process's table now
        for thread in hashers:
            assert os.path.exists(f"/proc/self/task/{thread.native_id}/fd/{handle.fileno()}"), thread.name


def test_a_raising_signal_handler_reaches_the_caller_after_the_write_ends(tmp_path: Path) -> None:
    """A handler raising while the caller waits for a private write (``KeyboardInterrupt`` at
    Ctrl-C): the exception reaches the caller only once the write has ended, so that its cleanup
    never removes a file that is still being written."""
    import signal

    from gpu_resilience_worker.storage import LocalStorage

    target = tmp_path / "data.bin"
    finished = []

    def produce(handle) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0.1)  # while the caller waits for this write
        for _ in range(10):
            handle.write(bytes(1 << 20))
            time.sleep(0.05)
        finished.append(time.monotonic())

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            LocalStorage().write(str(target), produce)
        raised = time.monotonic()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert finished and finished[0] <= raised
    assert target.stat().st_size == 10 << 20


def test_a_subprocess_storm_beside_background_saves_leaves_every_save_one_streamed_upload(strict_volume) -> None:
    """A thread running ``subprocess.run`` back to back (a monitoring loop calling a tool) beside
    ten background saves of a 32 MiB state on the strict volume: no save fails, nothing is
    staged. (Written in the caller, as where ``unshare`` is refused, such a run fails saves and
    stages them.)"""
    volume, _ = strict_volume
    bag = _Bag(32)
    config = CheckpointConfig(folder=str(volume.mountpoint / "run"), interval=1, keep_latest_k=2,
                              async_mode=AsyncMode.ASYNC)
    stop, started = threading.Event(), []

    def storm() -> None:
        while not stop.is_set():
            subprocess.run(["true"], check=True)
            started.append(1)

    thread = threading.Thread(target=storm)
    thread.start()
    try:
        with CheckpointManager(config, {"bag": bag}, logger=StructuredLogger(open(os.devnull, "w"))) as manager:
            for step in range(1, 11):
                bag.tensor.add_(1.0)
                manager.save(step)  # raises CheckpointSaveError had the previous save failed
                time.sleep(0.05)
            manager.wait_until_finished()
            assert manager.failed_saves == 0
            assert manager.valid_steps()[0] == 10
    finally:
        stop.set()
        thread.join(60)
    assert len(started) > 20, "too few subprocesses to have met a save"
    assert [e for e in volume.events() if e["kind"] in ("staged", "estale")] == []
