"""Worker faults on a really full disk: a small tmpfs (mounting it needs root) with room for the
small files but not a checkpoint. Every save fails with ENOSPC; the third in a row ends the attempt
with exit 74, nothing committed is touched, and the advisory files' failed writes are tolerated.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from gpu_resilience_worker.commit import CheckpointName
from tests.conftest import missing_from_env
from tests.faults.test_worker_faults import hashes, resumed_step, run_to_end
from tests.worker.conftest import SIGKILL, Task

pytestmark = pytest.mark.faults

#: The disk-full test's run: tensors of 1 MiB (``--hidden 512``), so that a save fails inside
#: ``torch.save``'s own write of a record, not in the writer's buffered small records; progress at
#: the default interval (1 s), and steps slow enough (18 of them take more than 1 s) that a
#: progress write falls due between a failing background save and the next save, which waits for it.
DISK_FLAGS = ("--steps", "120", "--hidden", "512", "--batch-size", "32", "--seed", "5",
              "--checkpoint-every", "10", "--keep", "2", "--step-delay", "0.06")
#: With background saves, each save that fails for want of space keeps the disk full until a
#: ``progress.json`` write was tried (``tests/worker/pausing.py``): that write fails too.
HOLD_FULL = {"WORKER_TEST_PAUSE_WHEN_FULL_SECONDS": "20"}
#: The size of the disk-full test's file system: room for three checkpoints of :data:`DISK_FLAGS`.
SMALL_DISK = 16 << 20
#: What the disk-full test leaves free: room for the small files an attempt writes (the write
#: probe, ``attempts.json``, ``progress.json``, the goodput file, ``FATAL``), not a checkpoint.
ROOM = 32 << 10


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real file system of :data:`SMALL_DISK` bytes (a tmpfs at ``tmp_path/disk``) that a test
    can fill: writes past its size fail with ENOSPC. Unmounted at teardown, always (lazily when a
    failed test left a process with a file open in it). Mounting needs root (CAP_SYS_ADMIN):
    skipped elsewhere, a failure under ``TESTS_REQUIRE_FULL_ENV=1``."""
    mountpoint = tmp_path / "disk"
    mountpoint.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK}", "tmpfs", str(mountpoint)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        missing_from_env(f"a tmpfs cannot be mounted here ({mounted.stderr.strip()})",
                         "run the fault suite as root (mount needs CAP_SYS_ADMIN)")
    try:
        yield mountpoint
    finally:
        if subprocess.run(["umount", str(mountpoint)]).returncode != 0:
            subprocess.run(["umount", "--lazy", str(mountpoint)], check=True)


def fill(disk: Path, leave: int) -> Path:
    """Write one file into ``disk`` until the file system is full (ENOSPC), then give ``leave``
    bytes of it back. :return: the file (delete it to free the disk)."""
    filler = disk / "filler"
    block = bytes(1 << 16)
    with open(filler, "wb", buffering=0) as handle:
        with pytest.raises(OSError) as full:
            while True:
                handle.write(block)
    assert full.value.errno == errno.ENOSPC, full.value
    os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


@pytest.mark.parametrize("mode", ["--async-save", "--sync-save"])
def test_disk_full_during_saves_ends_the_attempt_with_74_and_keeps_the_last_good_checkpoint(
        small_disk: Path, digits_npz: Path, tmp_path: Path, mode) -> None:
    """A really full file system (a tmpfs with room for the small files but not a checkpoint):
    every save fails with ENOSPC, background or not, and the third failure in a row ends the
    attempt early with exit 74 and ``FATAL``, both naming the folder and the error (not torch's
    "unexpected pos" of the torn writer); the committed checkpoints stay as they were; a retry
    with the disk still full exits at once; one after space was freed resumes bit-identically.
    A ``progress.json`` write that meets the full disk (beside a failing background save) is
    logged once and tolerated: it ended the attempt with exit 1 before the saves' rule could."""
    baseline = Task(root=tmp_path / "baseline", data=digits_npz)
    uninterrupted = baseline.start(mode, flags=DISK_FLAGS)
    assert uninterrupted.wait(timeout=300) == 0, uninterrupted.output[-4000:]
    task = Task(root=small_disk / "checkpoints", data=digits_npz)
    flags = (*DISK_FLAGS, mode)
    first = task.start(flags=flags)
    first.wait_for(lambda r: r.get("message") == "checkpoint saved" and r.get("step", 0) >= 30, timeout=120)
    first.signal(SIGKILL)
    first.wait()
    good = task.valid_steps()
    assert good
    for leftover in task.namespace.glob("ckpt-*"):  # what the kill left unfinished frees no room later
        if CheckpointName.parse(leftover.name).step not in good:
            leftover.unlink()
    committed = {p.name: p.read_bytes() for p in task.namespace.glob("ckpt-*")}
    assert (task.namespace / f"ckpt-{good[-1]:08d}.pt").stat().st_size > ROOM
    filler = fill(small_disk, ROOM)

    full = task.start(flags=flags, env=HOLD_FULL if mode == "--async-save" else None)
    code = full.wait(timeout=300)
    assert code == 74, f"exit {code}\n{full.output[-4000:]}"
    unwritten = [r for r in full.records if r.get("message", "").startswith("could not write progress.json")]
    assert len(unwritten) == (1 if mode == "--async-save" else 0), full.output[-4000:]
    assert "unexpected pos" not in full.output, full.output[-4000:]
    fatal = [r for r in full.records if r.get("message", "").startswith("fatal: ")]
    assert len(fatal) == 1 and fatal[0]["exit_code"] == 74, full.output[-4000:]
    reason = fatal[0]["reason"]
    assert str(task.namespace) in reason and "No space left on device" in reason, reason
    marker = json.loads((task.namespace / "FATAL").read_text())
    assert marker["exit_code"] == 74 and marker["reason"] == reason
    # three saves failed (in the background: each one surfaced at the next due save), then it stopped
    going_on = [r["failed_in_a_row"] for r in full.records if r.get("message") == "checkpoint save failed; training goes on"]
    assert going_on == [1, 2], full.output[-4000:]
    goodput = json.loads(next(task.namespace.glob("goodput-*-1.json")).read_text())
    assert goodput["status"] == "failed" and good[-1] + goodput["steps"] < 120, goodput
    assert {p.name: p.read_bytes() for p in task.namespace.glob("ckpt-*")} == committed
    assert task.valid_steps() == good

    again = task.start(flags=flags)  # a Cloud Run retry, the disk still full: no step trained
    assert again.wait(timeout=120) == 74, again.output[-4000:]
    assert not any("resumed_from_step" in r for r in again.records), again.output[-4000:]

    filler.unlink()  # space freed: the marker is not obeyed, the retry resumes
    after = run_to_end(task, flags)
    assert resumed_step(after) == good[-1]
    assert not (task.namespace / "FATAL").exists()
    assert hashes(task.metrics()) == hashes(baseline.metrics())
