"""Worker faults: FAULTS_N random SIGKILL/SIGTERM points across one long run, a vanishing
checkpoint directory, corrupt and malicious newest checkpoints, a newer release's checkpoint
found by a rolled-back worker (a full disk: ``test_worker_disk_full.py``).

Every lineage must end in a correct resume (model and optimizer sha256 equal to an uninterrupted
run with the same flags) or a clear sysexits error, and never load a checkpoint whose commit
record does not match its data.

Where FUSE works, the checkpoint folder of every run here (the uninterrupted baselines too) is on the emulator's Cloud Storage FUSE volume in strict mode (a write
that would fall back to a staged write fails with EIO and is recorded), and each test ends by checking the volume's records: no
staged write at all, and no throttled rewrite in an uninterrupted run. Elsewhere the folder is a
plain temporary directory (under ``TESTS_REQUIRE_FULL_ENV=1`` a missing FUSE fails instead).
The mount costs about 1 s for the module.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import require_fuse
from tests.faults.conftest import faults_n
from tests.worker.conftest import REPO_ROOT, SIGKILL, SIGTERM, Task, WorkerProcess

pytestmark = pytest.mark.faults

N = faults_n()
#: A small, fast model; long enough that N interruptions land before the end. No ``--threads``:
#: every attempt runs at torch's default intra-op thread count, where bit-exactness must hold.
STEPS = max(400, 50 * N)
FLAGS = ("--steps", str(STEPS), "--hidden", "32", "--batch-size", "32", "--seed", "3",
         "--checkpoint-every", "10", "--keep", "3", "--step-delay", "0.004")
SHORT = ("--steps", "120", "--hidden", "32", "--batch-size", "32", "--seed", "5",
         "--checkpoint-every", "10", "--keep", "3", "--step-delay", "0.004")


def hashes(metrics: dict) -> tuple[str, str]:
    return metrics["model_sha256"], metrics["optimizer_sha256"]


def resumed_step(process: WorkerProcess) -> int | None:
    for record in process.records:
        if "resumed_from_step" in record:
            return record["resumed_from_step"]
    return None


def run_to_end(task: Task, flags, attempts: int = 3) -> WorkerProcess:
    """Restart until the run completes (a retryable exit 1 is allowed, a sysexits code is not)."""
    for _ in range(attempts):
        process = task.start(flags=flags)
        code = process.wait(timeout=300)
        assert code in (0, 1), process.output[-4000:]
        if code == 0:
            return process
    pytest.fail(f"no completion in {attempts} attempts:\n{process.output[-4000:]}")


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    """The emulator's Cloud Storage FUSE mount in strict mode (``None`` where FUSE is unavailable;
    a failure instead under ``TESTS_REQUIRE_FULL_ENV=1``, see ``tests/conftest.py``).
    ``rename-dir-limit`` lets the vanishing-directory test rename a task folder."""
    from cloud_run_emulator.gcsfuse import GcsFuseMount

    if not require_fuse(fallback=True):
        yield None
        return
    base = tmp_path_factory.mktemp("fuse")
    with GcsFuseMount(base / "bucket", base / "mnt", base / "state", strict=True,
                      options=["rename-dir-limit=1000"]) as mount:
        yield mount


def _root(volume, fallback: Path, name: str) -> Path:
    return volume.mountpoint / name if volume is not None else fallback


def volume_summary(volume, root: Path) -> dict:
    """The FUSE volume's records of the objects under ``root`` (see ``gcsfuse.summarize``)."""
    from cloud_run_emulator.gcsfuse import summarize

    prefix = os.path.relpath(root, volume.mountpoint) + "/"
    return summarize([e for e in volume.events() if str(e.get("object", "")).startswith(prefix)])


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, digits_npz, volume) -> dict[str, tuple[str, str]]:
    """Uninterrupted runs with :data:`FLAGS` and :data:`SHORT`; their hashes are the reference.
    On the FUSE volume, such a full run makes no staged write and no throttled rewrite."""
    out = {}
    for name, flags in (("long", FLAGS), ("short", SHORT)):
        root = _root(volume, tmp_path_factory.mktemp(f"baseline-{name}"), f"baseline-{name}")
        task = Task(root=root, data=digits_npz)
        process = task.start(flags=flags)
        process.wait(timeout=600)
        assert process.proc.returncode == 0, process.output[-4000:]
        out[name] = hashes(task.metrics())
        if volume is not None:
            summary = volume_summary(volume, root)
            assert summary["staged"] == 0 and summary["throttled"] == 0, summary
    return out


@pytest.fixture
def task(tmp_path: Path, digits_npz: Path, volume) -> Task:
    """A task whose checkpoint root is on the FUSE volume (when there is one); the test fails
    when any write under it fell back to a staged write (EIO in strict mode)."""
    root = _root(volume, tmp_path / "checkpoints", tmp_path.name)
    yield Task(root=root, data=digits_npz)
    if volume is not None:
        summary = volume_summary(volume, root)
        assert summary["staged"] == 0, summary


#: Interruption kinds, cycled: (signal, test pause env, what to wait for before the signal).
KINDS = {
    "term": (SIGTERM, None, "started"),
    "kill": (SIGKILL, None, "started"),
    "kill-at-start": (SIGKILL, None, None),  # no waiting at all: startup, resume, first steps
    "kill-before-commit": (SIGKILL, {"WORKER_TEST_PAUSE_BEFORE_COMMIT_SECONDS": "0.4"}, "checkpoint data written"),
    "kill-mid-write": (SIGKILL, {"WORKER_TEST_PAUSE_MID_WRITE_SECONDS": "0.4"}, "checkpoint data half written"),
    "term-mid-write": (SIGTERM, {"WORKER_TEST_PAUSE_MID_WRITE_SECONDS": "0.4"}, "checkpoint data half written"),
    "term-before-commit": (SIGTERM, {"WORKER_TEST_PAUSE_BEFORE_COMMIT_SECONDS": "0.4"}, "checkpoint data written"),
}


def _awaited(what: str | None):
    if what == "started":
        return lambda r: "resumed_from_step" in r or r.get("message") == "no checkpoint found"
    return lambda r: r.get("message") == what


def test_random_kills_across_one_long_run_end_bit_identical(task: Task, baselines) -> None:
    """``FAULTS_N`` SIGKILL/SIGTERM points, inside saves and commits and at random times, each
    followed by a restart like a Cloud Run retry; the last good checkpoint never goes away and
    every resume starts from the newest checkpoint valid when the attempt began."""
    rng = random.Random(int(os.environ.get("FAULTS_SEED", "20261201")))
    kinds = list(KINDS)
    delivered, completed = 0, None
    newest_valid = 0
    for index in range(N):
        kind = kinds[index % len(kinds)] if index < len(kinds) else rng.choice(kinds)
        signum, env, what = KINDS[kind]
        mode = ("--async-save",) if rng.random() < 0.5 else ("--sync-save",)
        valid_before = task.valid_steps()
        process = task.start(*mode, env=env, flags=FLAGS)
        if what is None:
            time.sleep(rng.uniform(0.0, 3.0))
        elif process.wait_for(_awaited(what), timeout=120, allow_exit=True) is None:
            completed = process
        if completed is None:
            time.sleep(rng.uniform(0.0, 0.5) if what == "started" else rng.uniform(0.0, 0.2))
            if process.proc.poll() is None:
                process.signal(signum)
                delivered += 1
        code = process.wait(timeout=120)
        allowed = {0, 143, -SIGTERM} if signum == SIGTERM else {0, -SIGKILL}
        assert code in allowed, f"{kind}: exit {code}\n{process.output[-4000:]}"
        assert not process.messages("ERROR"), process.output[-4000:]
        step = resumed_step(process)
        if step is not None:
            expected = max(valid_before, default=0)  # the newest valid one; nothing here is damaged
            assert step == expected, f"{kind}: resumed from {step}, valid were {valid_before}"
        valid = task.valid_steps()
        # an empty list fails this too once a checkpoint was valid: losing them all is the worst case
        assert (valid[-1] if valid else 0) >= newest_valid, f"{kind}: last good checkpoint lost: {valid}"
        newest_valid = valid[-1] if valid else newest_valid
        if code == 0:
            completed = process
            break
    assert delivered >= min(N, len(KINDS)), f"only {delivered} of {N} interruptions landed"
    if completed is None:
        completed = run_to_end(task, FLAGS)
    metrics = task.metrics()
    assert hashes(metrics) == baselines["long"]
    assert [a["attempt"] for a in metrics["attempts"]] == sorted(a["attempt"] for a in metrics["attempts"])


def test_checkpoint_directory_vanishing_mid_run(task: Task, baselines, volume) -> None:
    """The task namespace is deleted while training: the worker goes on (or exits retryably), and
    the lineage still ends bit-identical."""
    process = task.start(flags=SHORT)
    process.wait_for(lambda r: r.get("message") == "checkpoint saved" and r.get("step", 0) >= 20, timeout=120)
    if volume is None:
        gone = task.namespace.with_name("vanished")
        os.rename(task.namespace, gone)  # atomically gone while the worker writes; then really deleted
        shutil.rmtree(gone)
    else:  # a bucket has no atomic folder delete: its objects go one by one while the worker writes
        for _ in range(20):
            shutil.rmtree(task.namespace, ignore_errors=True)
            if not task.namespace.exists():
                break
    code = process.wait(timeout=300)
    assert code in (0, 1), f"exit {code}\n{process.output[-4000:]}"
    if code != 0:
        run_to_end(task, SHORT)
    assert hashes(task.metrics()) == baselines["short"]


def _interrupted_lineage(task: Task) -> list[int]:
    """Run SHORT until step >= 60 is committed, SIGKILL it; :return: the valid steps."""
    process = task.start(flags=SHORT)
    process.wait_for(lambda r: r.get("message") == "checkpoint saved" and r.get("step", 0) >= 60, timeout=120)
    process.signal(SIGKILL)
    process.wait()
    valid = task.valid_steps()
    assert len(valid) >= 2, valid
    return valid


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped"])
def test_damaged_newest_checkpoint_is_skipped(task: Task, baselines, damage) -> None:
    valid = _interrupted_lineage(task)
    newest = task.namespace / f"ckpt-{valid[-1]:08d}.pt"
    data = bytearray(newest.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 3]
    else:
        data[len(data) // 2] ^= 0x10
    newest.unlink()  # a new object (rewriting one in place stages it on Cloud Storage FUSE)
    newest.write_bytes(bytes(data))
    resumed = run_to_end(task, SHORT)
    skipped = [r for r in resumed.messages("WARNING") if r.get("message") == "skipping invalid checkpoint"]
    assert [os.path.basename(r["file"]) for r in skipped][:1] == [newest.name], resumed.output[-4000:]
    assert resumed_step(resumed) == valid[-2]
    assert hashes(task.metrics()) == baselines["short"]


PAYLOAD = r"""
import pathlib, sys, torch
class Evil:
    def __init__(self, marker):
        self.marker = marker
    def __reduce__(self):
        return (pathlib.Path.write_text, (pathlib.Path(self.marker), "pwned"))
torch.save({"train_state": Evil(sys.argv[2]), "model": {}, "optimizer": {}, "lr_scheduler": {},
            "dataloader": {}}, sys.argv[1])
"""


def test_pickled_payload_with_a_matching_commit_record_is_refused(task: Task, baselines, tmp_path: Path) -> None:
    """The newest checkpoint is replaced by a malicious pickle whose commit record matches it
    (size and sha256): it is refused, never executed, and the run resumes from the previous one."""
    valid = _interrupted_lineage(task)
    newest = task.namespace / f"ckpt-{valid[-1]:08d}.pt"
    marker = tmp_path / "executed"
    newest.unlink()  # new objects: rewriting in place stages on Cloud Storage FUSE
    subprocess.run([sys.executable, "-c", PAYLOAD, str(newest), str(marker)], check=True, timeout=120)
    data = newest.read_bytes()
    record_path = task.namespace / f"ckpt-{valid[-1]:08d}.commit.json"
    record = json.loads(record_path.read_text())
    size = record["chunk_bytes"]  # forge a record of the sha256 format (still read): a matching hash list
    digests = [hashlib.sha256(data[o : o + size]).digest() for o in range(0, len(data), size)]
    record.pop("digest", None)
    record.update(size=len(data), chunks=[d.hex() for d in digests],
                  sha256=hashlib.sha256(b"".join(digests)).hexdigest())
    record_path.unlink()
    record_path.write_text(json.dumps(record))
    assert valid[-1] in task.valid_steps()  # the commit record matches: only the unpickler stands guard
    resumed = run_to_end(task, SHORT)
    assert not marker.exists(), "the pickled payload ran"
    skipped = [r for r in resumed.messages("WARNING") if r.get("message") == "skipping invalid checkpoint"]
    assert skipped and os.path.basename(skipped[0]["file"]) == newest.name, resumed.output[-4000:]
    assert "torch.load failed" in skipped[0]["reason"]
    assert resumed_step(resumed) == valid[-2]
    assert hashes(task.metrics()) == baselines["short"]


#: How a newer release's record differs, as a rolled-back worker finds it: (fields, reason part).
NEWER = {"format-99": ({"format": 99}, "has format 99"), "digest-blake9": ({"digest": "blake9"}, "has digest 'blake9'")}


@pytest.mark.parametrize("newer", NEWER, ids=NEWER)
def test_a_rolled_back_worker_refuses_a_newer_releases_checkpoint_and_deletes_nothing(task: Task, baselines,
                                                                                     newer: str) -> None:
    """The newest checkpoint's record has a format (or a chunk digest) this release does not know,
    as after the image was rolled back: the worker exits 78 with ``FATAL`` naming the record and
    what is newer, resumes nothing and deletes nothing (it resumed from the older checkpoint, and
    retention then deleted the newer one); a retry exits at once; once the record reads again (the
    newer release is back), the run resumes from it and ends bit-identical."""
    valid = _interrupted_lineage(task)
    fields, detail = NEWER[newer]
    path = task.namespace / f"ckpt-{valid[-1]:08d}.commit.json"
    original = path.read_bytes()
    path.unlink()  # new objects: rewriting in place stages on Cloud Storage FUSE
    path.write_bytes(json.dumps({**json.loads(original), **fields}, sort_keys=True).encode())
    before = {p.name: p.read_bytes() for p in task.namespace.glob("ckpt-*")}
    refused = task.start(flags=SHORT)
    assert refused.wait(timeout=120) == 78, refused.output[-4000:]
    fatal = [r for r in refused.records if r.get("message", "").startswith("fatal: ")]
    assert len(fatal) == 1 and fatal[0]["exit_code"] == 78, refused.output[-4000:]
    assert str(path) in fatal[0]["reason"] and detail in fatal[0]["reason"], fatal[0]["reason"]
    marker = json.loads((task.namespace / "FATAL").read_text())
    assert marker["reason"] == fatal[0]["reason"]
    assert marker["newer_record"] == {"file": str(path), "format": fields.get("format"), "digest": fields.get("digest")}
    assert not any("resumed_from_step" in r for r in refused.records), refused.output[-4000:]
    assert {p.name: p.read_bytes() for p in task.namespace.glob("ckpt-*")} == before  # nothing deleted or changed

    again = task.start(flags=SHORT)  # a Cloud Run retry: the marker holds while the record is newer
    assert again.wait(timeout=120) == 78, again.output[-4000:]
    assert {p.name: p.read_bytes() for p in task.namespace.glob("ckpt-*")} == before

    path.unlink()
    path.write_bytes(original)  # the newer release's reader is back: the record reads again
    resumed = run_to_end(task, SHORT)
    assert resumed_step(resumed) == valid[-1]
    assert not (task.namespace / "FATAL").exists()
    assert hashes(task.metrics()) == baselines["short"]


def _open_files(pid: int) -> set[str]:
    """:return: the paths process ``pid`` has open, in any of its threads' descriptor tables
    (``/proc/{pid}/task/*/fd``: the worker writes on a thread with a table of its own)."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fds = os.listdir(f"/proc/{pid}/task/{tid}/fd")
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        for fd in fds:
            try:
                found.add(os.readlink(f"/proc/{pid}/task/{tid}/fd/{fd}"))
            except FileNotFoundError:  # closed meanwhile
                continue
    return found


def test_a_killed_writers_short_object_never_becomes_a_valid_checkpoint(task: Task, baselines, volume) -> None:
    """Cost: about 10 s. SIGKILL halfway through writing a checkpoint's data, the file open: the kernel closes
    it, and Cloud Storage FUSE finalizes it as a short object (in the bucket, not only on the mount):
    exactly the half written, less than the whole checkpoint the worker was writing. It is
    never valid, the restart resumes from the checkpoint before it and removes it, and the
    lineage ends bit-identical."""
    first = task.start("--sync-save", flags=SHORT)
    first.wait_for(lambda r: r.get("message") == "checkpoint saved" and r.get("step", 0) >= 30, timeout=120)
    first.signal(SIGKILL)
    first.wait()
    good = task.valid_steps()
    paused = {"WORKER_TEST_PAUSE_MID_WRITE_SECONDS": "5"}
    second = task.start("--sync-save", env=paused, flags=SHORT)
    half = second.wait_for(lambda r: r.get("message") == "checkpoint data half written", timeout=120)
    assert half is not None, second.output[-4000:]
    short = Path(half["file"])
    if not short.is_absolute():
        short = REPO_ROOT / short
    # killed with the file still open: the kernel closes it, not the worker
    assert os.path.realpath(short) in _open_files(second.proc.pid), half
    second.signal(SIGKILL)
    second.wait()
    step = int(short.name.split("-")[1].split(".")[0])
    assert step > max(good)
    # the kill came with half of the data in the still open file: that much, less than all of it
    assert 0 < half["bytes"] < half["of"], half
    if volume is not None:  # the kernel's close finalized it as an object of the bucket, short
        in_bucket = volume.source / os.path.relpath(short, volume.mountpoint)
        assert in_bucket.exists() and in_bucket.stat().st_size == half["bytes"], half
    assert short.exists() and short.stat().st_size == half["bytes"] and step not in task.valid_steps()
    assert not (task.namespace / f"ckpt-{step:08d}.commit.json").exists()
    after = run_to_end(task, SHORT)
    assert resumed_step(after) == max(good)
    assert hashes(task.metrics()) == baselines["short"]
