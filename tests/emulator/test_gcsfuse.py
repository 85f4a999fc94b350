"""The emulator's FUSE volume against Cloud Storage FUSE's documented semantics (see
:mod:`cloud_run_emulator.gcsfuse`): what becomes an object and when, what falls back to
staged writes (and is ``EIO`` in strict mode), rename, rewrite throttling, ``ESTALE``, killed
writers, bytes read, and the folder fallback. Objects are checked through the real
google-cloud-storage client on the emulator's GCS endpoint.

Cost: about 15 s on two loaded cores (three mounts for the module, one emulator started and
hard-killed, one job).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from google.cloud import run_v2

from cloud_run_emulator import gcsfuse
from cloud_run_emulator.gcsfuse import GcsFuseMount, VolumeMounts
from cloud_run_emulator.gcsfuse_host import is_mounted
from cloud_run_emulator.gcsfuse_rules import DEFAULT_STREAMING_FILES
from cloud_run_emulator.process import EmulatorProcess

from .conftest import PARENT, make_job
from .test_api import _read, create, poll_execution

# Skipped where FUSE is unavailable; a failure instead under TESTS_REQUIRE_FULL_ENV=1 (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fuse")


@pytest.fixture(scope="module")
def fuse_bucket(storage_client):
    return storage_client.create_bucket(f"fuse-{uuid.uuid4().hex[:10]}")


def _mount(emulator, bucket, strict, options=(), name=None):
    base = Path(emulator.data_dir, "fuse-tests", f"{bucket.name}-{name or ('strict' if strict else 'normal')}")
    return GcsFuseMount(emulator.bucket_dir(bucket.name), base / "mnt", base / "state", strict=strict,
                        options=options)


@pytest.fixture(scope="module")
def mnt(emulator, fuse_bucket):
    with _mount(emulator, fuse_bucket, strict=False) as mount:
        yield mount


@pytest.fixture(scope="module")
def other_mnt(emulator, fuse_bucket):
    """A second mount of the same bucket (another machine's view of it)."""
    with _mount(emulator, fuse_bucket, strict=False, name="other") as mount:
        yield mount


@pytest.fixture(scope="module")
def strict(emulator, fuse_bucket):
    with _mount(emulator, fuse_bucket, strict=True, options=["rename-dir-limit=5"]) as mount:
        yield mount


def _name(prefix="f"):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _events(mount, name, kind=None):
    return [e for e in mount.events() if e["object"] == name and (kind is None or e["kind"] == kind)]


def _put(mount, name, data=b"0123456789"):
    with open(mount.mountpoint / name, "wb") as f:
        f.write(data)


def test_new_file_is_an_object_only_at_close_and_fsync_does_not_finalize(mnt, fuse_bucket):
    name = _name()
    f = open(mnt.mountpoint / name, "wb")
    f.write(b"x" * 300_000)
    f.flush()
    os.fsync(f.fileno())
    assert name in os.listdir(mnt.mountpoint)  # the writer's own mount shows the local file
    assert fuse_bucket.get_blob(name) is None and name not in [b.name for b in fuse_bucket.list_blobs()]
    f.write(b"y" * 100)
    f.close()
    blob = fuse_bucket.get_blob(name)
    assert blob is not None and blob.size == 300_100 and blob.download_as_bytes()[-100:] == b"y" * 100
    assert _events(mnt, name, "staged") == []  # a sequential new file streams


def test_a_new_open_after_a_close_is_an_overwrite_even_before_the_kernel_releases_the_closed_handle(
        mnt, fuse_bucket):
    """``close()`` uploads the file (FUSE's flush) but the kernel's release of that handle comes
    later, asynchronously; a dup of the descriptor holds it back here, as a busy machine's late
    release does. Opening the file again and writing is then an overwrite of the object (the
    whole object fetched, a read), as it is after the release, not a write-after-close of the
    closed handle (a CI run on 2 busy cores once saw that)."""
    name = _name()
    fd = os.open(mnt.mountpoint / name, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"one")
    held = os.dup(fd)
    os.close(fd)  # flush: uploaded; no release while `held` keeps the description open
    try:
        assert fuse_bucket.get_blob(name).download_as_bytes() == b"one"
        with open(mnt.mountpoint / name, "r+b") as f:
            f.write(b"tw")
        assert fuse_bucket.get_blob(name).download_as_bytes() == b"twe"
        assert [(e["cause"], e["bytes"]) for e in _events(mnt, name, "staged")] == [("overwrite", 3)]
        assert [e["bytes"] for e in _events(mnt, name, "read")] == [3]  # the fetch of the object
    finally:
        os.close(held)


def test_overwrite_of_an_existing_object_is_staged_and_eio_in_strict_mode(mnt, strict, fuse_bucket):
    name = _name()
    _put(mnt, name)
    with open(mnt.mountpoint / name, "r+b") as f:
        f.write(b"AB")
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"AB23456789"
    staged = _events(mnt, name, "staged")
    assert [(e["cause"], e["bytes"]) for e in staged] == [("overwrite", 10)]
    with open(strict.mountpoint / name, "r+b", buffering=0) as f:
        with pytest.raises(OSError) as err:
            f.write(b"CD")
        assert err.value.errno == errno.EIO
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"AB23456789"


def test_truncation_is_staged_and_eio_in_strict_mode(mnt, strict, fuse_bucket):
    name = _name()
    _put(mnt, name)
    os.truncate(mnt.mountpoint / name, 4)
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"0123"
    assert [e["cause"] for e in _events(mnt, name, "staged")] == ["truncate"]
    with pytest.raises(OSError) as err:
        os.truncate(strict.mountpoint / name, 2)
    assert err.value.errno == errno.EIO and fuse_bucket.get_blob(name).size == 4
    with pytest.raises(OSError) as err:  # open(O_TRUNC) of an existing object
        open(strict.mountpoint / name, "wb")
    assert err.value.errno == errno.EIO and fuse_bucket.get_blob(name).size == 4
    _put(mnt, name, b"new")
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"new"
    assert [(e["cause"], e["bytes"]) for e in _events(mnt, name, "staged")] == [("truncate", 4), ("truncate", 3)]


def test_out_of_order_write_is_staged_and_eio_in_strict_mode(mnt, strict, fuse_bucket):
    name = _name()
    with open(mnt.mountpoint / name, "wb") as f:
        f.write(b"a" * 10)
        f.flush()
        f.seek(100)
        f.write(b"b")
    assert fuse_bucket.get_blob(name).size == 101
    assert [e["cause"] for e in _events(mnt, name, "staged")] == ["out-of-order-write"]
    other = _name()
    f = open(strict.mountpoint / other, "wb", buffering=0)
    f.write(b"a" * 10)
    with pytest.raises(OSError) as err:
        os.pwrite(f.fileno(), b"b", 100)
    assert err.value.errno == errno.EIO
    f.close()
    assert fuse_bucket.get_blob(other).size == 10  # what was streamed is finalized at close


def test_read_while_writing_finalizes_then_stages_and_is_eio_in_strict_mode(mnt, strict, fuse_bucket):
    name = _name()
    f = open(mnt.mountpoint / name, "wb", buffering=0)
    f.write(b"first")
    assert (mnt.mountpoint / name).read_bytes() == b"first"
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"first"  # the read finalized it
    f.write(b"-second")
    f.close()
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"first-second"
    assert [e["cause"] for e in _events(mnt, name, "staged")] == ["read-while-writing"]
    other = _name()
    g = open(strict.mountpoint / other, "wb", buffering=0)
    g.write(b"data")
    with pytest.raises(OSError) as err:
        (strict.mountpoint / other).read_bytes()
    assert err.value.errno == errno.EIO
    g.close()
    assert fuse_bucket.get_blob(other).download_as_bytes() == b"data"


def test_rename_is_copy_then_delete_and_directory_rename_is_refused(mnt, strict, fuse_bucket):
    name, new = _name(), _name("renamed")
    _put(mnt, name)
    os.rename(mnt.mountpoint / name, mnt.mountpoint / new)
    assert fuse_bucket.get_blob(name) is None and fuse_bucket.get_blob(new).download_as_bytes() == b"0123456789"
    [event] = _events(mnt, name, "non-atomic-rename")
    assert event["to"] == new and event["bytes"] == 10
    folder = _name("dir")
    os.mkdir(mnt.mountpoint / folder)
    _put(mnt, f"{folder}/a")
    with pytest.raises(OSError) as err:  # a flat bucket without rename-dir-limit: EMFILE, as gcsfuse
        os.rename(mnt.mountpoint / folder, mnt.mountpoint / f"{folder}-moved")
    assert err.value.errno == errno.EMFILE and fuse_bucket.get_blob(f"{folder}/a") is not None
    os.rename(strict.mountpoint / folder, strict.mountpoint / f"{folder}-moved")  # rename-dir-limit=5
    assert fuse_bucket.get_blob(f"{folder}-moved/a") is not None and fuse_bucket.get_blob(f"{folder}/a") is None
    assert [e.get("objects") for e in _events(strict, folder, "non-atomic-rename")] == [1]


def test_rewrite_within_a_second_is_recorded_as_throttled(mnt, fuse_bucket):
    name = _name()
    _put(mnt, name, b"one")
    os.unlink(mnt.mountpoint / name)
    _put(mnt, name, b"two")  # a new file again, so it streams: only the rate is wrong
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"two"
    assert len(_events(mnt, name, "throttled-rewrite")) == 1 and _events(mnt, name, "staged") == []


_TASK_WRITER = ("import os,sys\nf=open(sys.argv[1],'wb',buffering=0)\nf.write(sys.argv[2].encode())\n"
                "print('written',flush=True)\nsys.stdin.readline()\n"
                "try:\n    f.close(); print('closed')\nexcept OSError as e:\n    print(e.errno)\n")


def _task_env(execution, index=0):
    return {**os.environ, "CLOUD_RUN_EXECUTION": execution, "CLOUD_RUN_TASK_INDEX": str(index),
            "CLOUD_RUN_TASK_ATTEMPT": "0"}


@pytest.mark.parametrize("where", ["two mounts", "two tasks on one mount"])
def test_second_writer_of_one_object_gets_estale_at_close(mnt, other_mnt, fuse_bucket, where):
    """Two mounts of one bucket write one object: the first close wins, the other gets ESTALE;
    so do two tasks on the emulator's one mount (on Cloud Run each task has its own)."""
    name = _name()
    theirs = other_mnt if where == "two mounts" else mnt
    env = _task_env("exec-first") if where == "two mounts" else _task_env("exec-second")
    first = open(mnt.mountpoint / name, "wb")
    second = subprocess.Popen([sys.executable, "-c", _TASK_WRITER, str(theirs.mountpoint / name), "second"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert second.stdout.readline().strip() == "written"
    first.write(b"first")
    first.close()
    out, _ = second.communicate("\n", timeout=30)
    assert out.strip() == str(errno.ESTALE)
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"first"
    assert (theirs.mountpoint / name).read_bytes() == b"first"  # the loser's mount reads the winner's object
    assert len(_events(theirs, name, "estale")) == 1
    if theirs is not mnt:
        assert _events(mnt, name, "estale") == []  # recorded by the loser's mount only


def test_handles_of_one_task_share_the_file_they_write(mnt, fuse_bucket):
    """gcsfuse has one inode per file and mount: a second append handle of the same task goes on
    where the first one's bytes end (no zeros, no ESTALE), and ftruncate cuts the file of the
    handle it is called on."""
    name = _name("log")
    a = open(mnt.mountpoint / name, "ab", buffering=0)
    a.write(b"line one\n")
    b = open(mnt.mountpoint / name, "ab", buffering=0)
    b.write(b"line two\n")
    b.close()
    a.close()
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"line one\nline two\n"
    assert _events(mnt, name, "staged") == [] and _events(mnt, name, "estale") == []
    other = _name()
    _put(mnt, other, b"0123456789" * 2)
    a = os.open(mnt.mountpoint / other, os.O_RDWR)
    b = os.open(mnt.mountpoint / other, os.O_WRONLY)  # a concurrent opener (touch) of the same task
    os.write(a, b"HEAD")
    os.ftruncate(a, 4)
    assert os.fstat(a).st_size == 4
    os.close(a)
    os.close(b)
    assert fuse_bucket.get_blob(other).download_as_bytes() == b"HEAD"


def test_killed_writer_leaves_a_short_object(mnt, fuse_bucket):
    name = _name()
    script = ("import os,signal,sys\nf=open(sys.argv[1],'wb',buffering=0)\n"
              "f.write(b'z'*(1<<20)); os.kill(os.getpid(), signal.SIGKILL); f.write(b'never')\n")
    proc = subprocess.run([sys.executable, "-c", script, str(mnt.mountpoint / name)], check=False)
    assert proc.returncode == -signal.SIGKILL
    blob = fuse_bucket.get_blob(name)  # the kernel closed the file: finalized as it was
    assert blob is not None and blob.size == 1 << 20


def test_reads_go_to_storage_each_time_and_are_counted(mnt, fuse_bucket):
    name = _name()
    fuse_bucket.blob(name).upload_from_string(b"r" * 200_000)  # through the Storage API
    for _ in range(2):
        assert (mnt.mountpoint / name).read_bytes() == b"r" * 200_000
    assert mnt.stats()["bytesRead"][name] == 400_000


def test_fallback_to_folders_when_fuse_is_unavailable(monkeypatch, tmp_path):
    monkeypatch.setattr(gcsfuse.os.path, "exists", lambda path: path != "/dev/fuse" and os.access(path, os.F_OK))
    mounts = VolumeMounts(tmp_path, lambda bucket: tmp_path / "gcs" / bucket)
    assert mounts.kind == "folder"
    assert mounts.banner() == ("cloud-storage volumes: plain folders, FUSE unavailable (no /dev/fuse); "
                               "gcsfuse semantics not emulated")
    assert mounts.local_dir("b") == tmp_path / "gcs" / "b"
    with pytest.raises(RuntimeError, match="FUSE requested but unavailable: no /dev/fuse"):
        VolumeMounts(tmp_path, lambda bucket: tmp_path, mode="fuse")


def test_job_attempt_records_and_logs_show_the_events_and_bad_mount_options_are_refused(
        jobs, executions, emulator, bucket, job_id):
    script = "import os; f = os.environ['F']; open(f, 'w').write('one'); open(f, 'r+').write('two')"
    spec = make_job("local/sh", env={"F": "/checkpoints/state.txt"}, bucket=bucket.name,
                    args=[f'{sys.executable} -c "{script}"'])
    spec.template.template.volumes[0].gcs.mount_options = ["rename-dir-limit=3"]
    execution = poll_execution(executions, jobs.run_job(name=create(jobs, job_id, spec).name).metadata.name)
    assert execution.succeeded_count == 1
    [attempt] = emulator.attempts(execution.name)
    kinds = {(e["kind"], e.get("cause")) for e in attempt["fuseEvents"]}
    assert kinds == {("throttled-rewrite", None), ("staged", "overwrite"), ("read", None)}  # read: its fetch
    assert all(e["execution"] == execution.name.rsplit("/", 1)[-1] for e in attempt["fuseEvents"])
    log = _read(f"{emulator.endpoint}/_emulator/logs/{execution.name}").decode()
    assert "==> gcsfuse events <==" in log and f"gcsfuse throttled-rewrite: {bucket.name}/state.txt" in log
    assert emulator.volumes()["type"] == "fuse" and emulator.volume_dir(bucket.name, ["rename-dir-limit=3"]).parent.is_mount()

    bad = make_job("local/sh", bucket=bucket.name, args=["true"])
    for option, says in (("--implicit-dirs", "without the leading '--'"), ("cache-everything", "allowed: dir-mode"),
                         ("rename-dir-limit=x", "needs a non-negative int")):
        bad.template.template.volumes[0].gcs.mount_options = [option]
        with pytest.raises(Exception) as err:
            jobs.create_job(parent=PARENT, job=bad, job_id=f"{job_id}-bad").result(timeout=10)
        assert "volumes[0].gcs.mount_options[0]" in str(err.value) and says in str(err.value)


def test_no_mount_is_left_when_the_emulator_is_hard_killed(tmp_path, images_file, storage_client):
    emu = EmulatorProcess(tmp_path / "emu", images_file=images_file, grace_seconds=1.0)
    emu.__enter__()
    try:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        client = storage.Client(project="p", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": emu.gcs_endpoint})
        bucket = client.create_bucket(_name("kill"))
        jobs = run_v2.JobsClient(credentials=AnonymousCredentials(), transport="rest",
                                 client_options={"api_endpoint": emu.endpoint})
        execs = run_v2.ExecutionsClient(credentials=AnonymousCredentials(), transport="rest",
                                        client_options={"api_endpoint": emu.endpoint})
        job = create(jobs, "kill-job", make_job("local/sh", bucket=bucket.name, args=["true"]))
        poll_execution(execs, jobs.run_job(name=job.name).metadata.name)
        point = emu.volume_dir(bucket.name).parent
        assert point.is_mount()
    finally:
        os.kill(emu.pid, signal.SIGKILL)
        emu._popen.wait()
    deadline = time.monotonic() + 10
    while str(point) in Path("/proc/self/mounts").read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert str(point) not in Path("/proc/self/mounts").read_text()


def test_more_files_streaming_at_once_than_the_limit_fall_back_to_staging(mnt, fuse_bucket):
    names = [_name("many") for _ in range(DEFAULT_STREAMING_FILES + 1)]
    files = [open(mnt.mountpoint / name, "wb", buffering=0) for name in names]
    for f in files:
        f.write(b"abc")
    for f in files:
        f.close()
    assert [e["cause"] for name in names for e in _events(mnt, name, "staged")] == ["streaming-limit"]
    assert _events(mnt, names[-1], "staged") and all(fuse_bucket.get_blob(n).size == 3 for n in names)


# --- what an attempt to break the mount found (each was wrong before) -----------------------

def test_an_object_opened_for_writing_shows_the_object_until_written_and_appends_after_it(mnt, fuse_bucket):
    """Opened ``r+`` or ``a`` with nothing written yet, the file is the object: its size, its
    bytes (a read does not upload the empty local copy over it), and an append goes after it."""
    name = _name()
    _put(mnt, name)
    with open(mnt.mountpoint / name, "r+b") as f:
        assert os.fstat(f.fileno()).st_size == 10 and os.stat(mnt.mountpoint / name).st_size == 10
        assert f.read() == b"0123456789"
        assert (mnt.mountpoint / name).read_bytes() == b"0123456789"  # another opener reads the object
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"0123456789"
    with open(mnt.mountpoint / name, "ab") as f:
        f.write(b"AB")
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"0123456789AB"
    assert [e["cause"] for e in _events(mnt, name, "staged")] == ["overwrite"]


def test_ftruncate_through_a_write_handle_keeps_the_objects_bytes_and_is_eio_in_strict_mode(
        mnt, strict, fuse_bucket):
    name = _name()
    _put(mnt, name)
    fd = os.open(mnt.mountpoint / name, os.O_WRONLY)
    os.ftruncate(fd, 3)
    os.close(fd)
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"012"
    fd = os.open(mnt.mountpoint / name, os.O_WRONLY)
    os.ftruncate(fd, 0)
    os.close(fd)
    assert fuse_bucket.get_blob(name).download_as_bytes() == b""
    assert [(e["cause"], e["bytes"]) for e in _events(mnt, name, "staged")] == [("truncate", 3), ("truncate", 0)]
    other = _name()
    _put(mnt, other)
    fd = os.open(strict.mountpoint / other, os.O_WRONLY)
    with pytest.raises(OSError) as err:
        os.ftruncate(fd, 0)
    os.close(fd)
    assert err.value.errno == errno.EIO and fuse_bucket.get_blob(other).size == 10


def test_a_file_renamed_while_open_for_writing_is_uploaded_first_and_written_on_as_a_staged_rewrite(
        mnt, strict, fuse_bucket):
    name, new = _name(), _name("renamed")
    f = open(mnt.mountpoint / name, "wb", buffering=0)
    f.write(b"before")
    os.rename(mnt.mountpoint / name, mnt.mountpoint / new)
    assert fuse_bucket.get_blob(name) is None and fuse_bucket.get_blob(new).download_as_bytes() == b"before"
    f.write(b"-after")
    assert fuse_bucket.get_blob(new).download_as_bytes() == b"before"  # not written into the object
    f.close()  # no ESTALE: the handle's object is the renamed one
    assert fuse_bucket.get_blob(new).download_as_bytes() == b"before-after"
    assert [e["cause"] for e in _events(mnt, new, "staged")] == ["write-after-rename"]
    assert _events(mnt, new, "estale") == []
    other, moved = _name(), _name("renamed")
    g = open(strict.mountpoint / other, "wb", buffering=0)
    g.write(b"data")
    os.rename(strict.mountpoint / other, strict.mountpoint / moved)
    with pytest.raises(OSError) as err:
        g.write(b"more")
    assert err.value.errno == errno.EIO
    g.close()
    assert fuse_bucket.get_blob(moved).download_as_bytes() == b"data"


def test_an_unlinked_open_file_leaves_no_object(mnt, fuse_bucket):
    name = _name()
    _put(mnt, name)
    f = open(mnt.mountpoint / name, "r+b", buffering=0)
    g = open(mnt.mountpoint / f"{name}-new", "wb", buffering=0)
    os.unlink(mnt.mountpoint / name)
    os.unlink(mnt.mountpoint / f"{name}-new")
    assert g.write(b"written after the unlink") == 24
    f.close()
    g.close()
    assert [b.name for b in fuse_bucket.list_blobs() if b.name.startswith((name, ".fuse_hidden"))] == []


def test_touch_and_cp_p_set_the_time_without_a_new_generation(mnt, fuse_bucket, tmp_path):
    name = _name()
    _put(mnt, name)
    before = time.time()
    os.utime(mnt.mountpoint / name)  # touch: "now" (UTIME_NOW)
    assert os.stat(mnt.mountpoint / name).st_mtime >= before - 1
    source = tmp_path / "src"
    source.write_bytes(b"copied")
    os.utime(source, (1_600_000_000, 1_600_000_000))
    subprocess.run(["cp", "-p", str(source), str(mnt.mountpoint / name)], check=True)  # onto the object
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"copied"
    assert os.stat(mnt.mountpoint / name).st_mtime == 1_600_000_000
    assert _events(mnt, name, "estale") == []


def test_the_streaming_limit_counts_the_files_of_one_task(mnt, fuse_bucket):
    """On Cloud Run each task has its own mount: two tasks streaming three files each (six on
    the emulator's one mount) stay under the per-mount limit of four."""
    script = ("import sys\nfs=[open(p,'wb',buffering=0) for p in sys.argv[1:]]\n"
              "[f.write(b'abc') for f in fs]\nprint('open', flush=True)\nsys.stdin.readline()\n"
              "[f.close() for f in fs]\n")
    names = [[_name(f"task{t}") for _ in range(3)] for t in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", script, *(str(mnt.mountpoint / n) for n in task)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "CLOUD_RUN_EXECUTION": "exec-a", "CLOUD_RUN_TASK_INDEX": str(t),
                                   "CLOUD_RUN_TASK_ATTEMPT": "0"})
             for t, task in enumerate(names)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "open"
    for proc in procs:
        proc.communicate("\n", timeout=30)
        assert proc.returncode == 0
    assert [e for task in names for n in task for e in _events(mnt, n, "staged")] == []
    assert all(fuse_bucket.get_blob(n).size == 3 for task in names for n in task)


def test_a_mount_point_with_a_space_mounts_and_unmounts(emulator, fuse_bucket):
    base = Path(emulator.data_dir, "fuse-tests", f"{fuse_bucket.name} spaced")
    with GcsFuseMount(emulator.bucket_dir(fuse_bucket.name), base / "mount point", base / "state") as mount:
        assert is_mounted(str(mount.mountpoint))
        _put(mount, "spaced", b"ok")
    assert not is_mounted(str(mount.mountpoint)) and fuse_bucket.get_blob("spaced").size == 2


def test_state_dir_on_another_file_system_is_refused_before_mounting(emulator, fuse_bucket):
    base = Path(emulator.data_dir, "fuse-tests", "other-fs")
    with pytest.raises(ValueError, match="is not on the file system of source"):
        GcsFuseMount(emulator.bucket_dir(fuse_bucket.name), base / "mnt", "/dev/shm/gcsfuse-state-test").start()
    assert not is_mounted(str(base / "mnt"))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root)")
def test_a_rename_on_a_full_disk_succeeds_though_its_record_is_lost(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        with GcsFuseMount(disk / "bucket", tmp_path / "mnt", disk / "state") as mount:
            _put(mount, "a", b"payload")
            with open(disk / "state" / "filler", "wb") as filler:
                with pytest.raises(OSError):
                    while True:
                        filler.write(b"\0" * 65536)
                        filler.flush()
            os.rename(mount.mountpoint / "a", mount.mountpoint / "b")
            assert (disk / "bucket" / "b").read_bytes() == b"payload" and not (disk / "bucket" / "a").exists()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_only_dir_mounts_a_folder_of_the_bucket_and_each_mount_says_whether_it_is_strict(
        emulator, fuse_bucket, tmp_path):
    volumes = VolumeMounts(tmp_path / "data", emulator.bucket_dir, mode="fuse")
    try:
        folder = volumes.local_dir(fuse_bucket.name, ["only-dir=runs/a", "x-emulator-strict"])
        assert folder.name == "a" and folder.parent.parent.parent.is_mount()
        (folder / "state.txt").write_bytes(b"in a folder")
        assert fuse_bucket.get_blob("runs/a/state.txt").download_as_bytes() == b"in a folder"
        same = volumes.local_dir(fuse_bucket.name, ["x-emulator-strict=true"])  # one mount, its root
        assert same == folder.parent.parent
        [mount] = volumes.describe()["mounts"]
        assert mount["strict"] is True and volumes.describe()["strict"] is False
        with pytest.raises(OSError) as err:  # strict: an overwrite is EIO
            with open(folder / "state.txt", "r+b", buffering=0) as f:
                f.write(b"x")
        assert err.value.errno == errno.EIO
    finally:
        volumes.stop()


def test_shell_redirection_and_empty_objects_stream(mnt, strict, fuse_bucket):
    """``echo > f`` (bash dup2s the new file, then closes the first descriptor: an empty object is
    uploaded, then written) and a write to an existing empty object stream, as in gcsfuse; so do
    extending a new file with ftruncate and writing it from 0."""
    for mount in (mnt, strict):
        name = _name("redirect")
        subprocess.run(["bash", "-c", f"echo hello > '{mount.mountpoint / name}'"], check=True)
        assert fuse_bucket.get_blob(name).download_as_bytes() == b"hello\n"
        assert _events(mount, name, "staged") == []
        empty = _name("empty")
        (mount.mountpoint / empty).touch()
        with open(mount.mountpoint / empty, "r+b") as f:
            f.write(b"now")
        assert fuse_bucket.get_blob(empty).download_as_bytes() == b"now" and _events(mount, empty, "staged") == []
        sized = _name("sized")
        fd = os.open(mount.mountpoint / sized, os.O_WRONLY | os.O_CREAT)
        os.ftruncate(fd, 8)
        os.write(fd, b"ab")
        os.write(fd, b"cd")
        os.close(fd)
        assert fuse_bucket.get_blob(sized).download_as_bytes() == b"abcd\0\0\0\0"
        assert _events(mount, sized, "staged") == []


def test_a_refused_write_leaves_the_file_as_it_was(strict, fuse_bucket):
    name = _name()
    fd = os.open(strict.mountpoint / name, os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"data")
    dup = os.dup(fd)
    os.close(fd)  # uploads it
    with pytest.raises(OSError) as err:
        os.write(dup, b"more")  # a write after close: staged, so EIO in strict mode
    assert err.value.errno == errno.EIO
    os.close(dup)  # no EINVAL, no second upload
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"data"
    assert _events(strict, name, "throttled-rewrite") == []
    assert "Traceback" not in strict.log_path.read_text()


def test_rename_flags_are_refused_and_folders_with_files_not_uploaded_stay(mnt, fuse_bucket):
    import ctypes

    a, b = _name("a"), _name("b")
    _put(mnt, a, b"AAAA")
    _put(mnt, b, b"BBBB")
    libc = ctypes.CDLL(None, use_errno=True)
    exchange = 2  # RENAME_EXCHANGE
    rc = libc.renameat2(-100, str(mnt.mountpoint / a).encode(), -100, str(mnt.mountpoint / b).encode(), exchange)
    assert rc == -1 and ctypes.get_errno() == errno.EINVAL
    assert fuse_bucket.get_blob(a).download_as_bytes() == b"AAAA"
    assert fuse_bucket.get_blob(b).download_as_bytes() == b"BBBB"
    folder = _name("dir")
    os.mkdir(mnt.mountpoint / folder)
    f = open(mnt.mountpoint / folder / "open", "wb")
    for call, code in ((lambda: os.rename(mnt.mountpoint / folder, mnt.mountpoint / f"{folder}-moved"), errno.ENOTSUP),
                       (lambda: os.rmdir(mnt.mountpoint / folder), errno.ENOTEMPTY)):
        with pytest.raises(OSError) as err:
            call()
        assert err.value.errno == code
    f.close()
    assert fuse_bucket.get_blob(f"{folder}/open") is not None


def test_renaming_onto_a_name_written_within_a_second_is_throttled(mnt, fuse_bucket):
    name = _name("progress")
    for i in range(3):
        _put(mnt, f"{name}.tmp", str(i).encode())
        os.rename(mnt.mountpoint / f"{name}.tmp", mnt.mountpoint / name)
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"2"
    assert len(_events(mnt, name, "throttled-rewrite")) == 2


def test_a_handle_left_open_after_another_closed_goes_on_with_the_same_file(mnt, fuse_bucket):
    """One task, two handles: after the first close uploads the file, a truncation or a write
    through the other handle is a staged rewrite uploaded at its close, and a third open of the
    task shares the file too (no ESTALE from itself)."""
    name = _name()
    _put(mnt, name)
    a = os.open(mnt.mountpoint / name, os.O_RDWR)
    b = os.open(mnt.mountpoint / name, os.O_RDWR)
    os.write(a, b"AB")
    os.close(a)
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"AB23456789"
    os.ftruncate(b, 3)
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"AB23456789"  # not the object itself
    c = os.open(mnt.mountpoint / name, os.O_WRONLY | os.O_APPEND)
    os.write(c, b"CC")
    os.close(b)
    os.close(c)
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"AB2CC"
    assert _events(mnt, name, "estale") == []
    assert [e["cause"] for e in _events(mnt, name, "staged")][-1] == "truncate"


def test_a_deleted_file_is_not_uploaded_by_a_read_or_fsync(mnt, fuse_bucket):
    name = _name()
    fd = os.open(mnt.mountpoint / name, os.O_RDWR | os.O_CREAT)
    os.write(fd, b"gone")
    os.unlink(mnt.mountpoint / name)
    os.pread(fd, 4, 0)
    os.fsync(fd)
    os.close(fd)
    assert fuse_bucket.get_blob(name) is None


def test_another_tasks_writes_are_its_own_until_closed(mnt, fuse_bucket):
    """Task B's file not uploaded yet is not in task A's listing or stat; A renaming or deleting
    an object B is writing leaves B's bytes out and gives B ESTALE (gcsfuse docs/semantics.md,
    "File Renaming/Deletion During Write")."""
    new, renamed, deleted = _name("new"), _name("renamed"), _name("deleted")
    _put(mnt, renamed, b"orig")
    _put(mnt, deleted, b"orig")
    script = ("import os,sys\nfs=[os.open(sys.argv[1],os.O_WRONLY|os.O_CREAT)]+[os.open(p,os.O_RDWR) for p in sys.argv[2:]]\n"
              "[os.write(f,b'task b') for f in fs]\nprint('written',flush=True)\nsys.stdin.readline()\n"
              "for f in fs:\n    try:\n        os.close(f); print('ok')\n    except OSError as e:\n        print(e.errno)\n")
    b = subprocess.Popen([sys.executable, "-c", script, *(str(mnt.mountpoint / n) for n in (new, renamed, deleted))],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_task_env("exec-b"))
    assert b.stdout.readline().strip() == "written"
    assert new not in os.listdir(mnt.mountpoint)
    with pytest.raises(FileNotFoundError):
        os.stat(mnt.mountpoint / new)
    assert os.stat(mnt.mountpoint / renamed).st_size == 4
    os.rename(mnt.mountpoint / renamed, mnt.mountpoint / f"{renamed}-moved")
    os.unlink(mnt.mountpoint / deleted)
    out, _ = b.communicate("\n", timeout=30)
    assert out.split() == ["ok", str(errno.ESTALE), str(errno.ESTALE)]
    assert fuse_bucket.get_blob(new).download_as_bytes() == b"task b"
    assert fuse_bucket.get_blob(f"{renamed}-moved").download_as_bytes() == b"orig"
    assert fuse_bucket.get_blob(renamed) is None and fuse_bucket.get_blob(deleted) is None


def test_reads_through_a_write_handle_and_a_staged_fetch_are_counted(mnt, fuse_bucket):
    name = _name()
    fuse_bucket.blob(name).upload_from_string(b"r" * 100_000)
    with open(mnt.mountpoint / name, "r+b") as f:
        assert len(f.read()) == 100_000
    with open(mnt.mountpoint / name, "r+b") as f:
        f.write(b"w")  # the staged write downloads the object first
    assert mnt.stats()["bytesRead"][name] == 200_000


@pytest.mark.parametrize("child", ["fork-exit", "subprocess"])
def test_a_child_closing_its_inherited_copy_of_a_file_still_being_written_finalizes_it(
        mnt, strict, fuse_bucket, child):
    """The kernel sends FUSE a flush at every close() of a descriptor, and a process forked while
    a file is open holds a copy of its descriptor: when that child exits (a DataLoader worker,
    a ``multiprocessing`` helper) or execs (``subprocess``, whose child closes every descriptor
    it does not pass on), the file is finalized with the bytes written so far, as gcsfuse syncs
    a file at each flush. The writer's next write is then a staged rewrite (``EIO`` in strict
    mode), and the partial object is visible: only a commit record that follows the writer's
    own successful close may make it a checkpoint."""
    def spawn_and_reap() -> None:
        if child == "fork-exit":
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        else:
            subprocess.run([sys.executable, "-c", "pass"], check=True)

    name = _name()
    with open(mnt.mountpoint / name, "wb", buffering=0) as f:
        f.write(b"a" * 1000)
        spawn_and_reap()
        blob = fuse_bucket.get_blob(name)
        assert blob is not None and blob.size == 1000  # finalized mid-write by the child's close
        f.write(b"b" * 1000)
    assert fuse_bucket.get_blob(name).size == 2000
    assert [e["cause"] for e in _events(mnt, name, "staged")] == ["write-after-close"]

    name = _name()
    f = open(strict.mountpoint / name, "wb", buffering=0)
    try:
        f.write(b"a" * 1000)
        spawn_and_reap()
        with pytest.raises(OSError) as raised:
            f.write(b"b" * 1000)
        assert raised.value.errno == errno.EIO
    finally:
        f.close()
    assert fuse_bucket.get_blob(name).size == 1000  # what the child's close finalized
    refused = _events(strict, name, "staged")
    assert [(e["cause"], e.get("refused")) for e in refused] == [("write-after-close", "EIO (strict mode)")]
