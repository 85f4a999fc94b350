"""The emulator's FUSE mounts themselves: bytes read counted, the folder fallback where FUSE is
unavailable, a job's attempt records and logs showing the events, refused mount options, no mount
left after a hard kill, odd mount points and state folders, ``only-dir``. The mounts and the helpers
are in ``conftest.py``; see ``test_gcsfuse.py`` for the rest.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from google.cloud import run_v2

from cloud_run_emulator import gcsfuse
from cloud_run_emulator.gcsfuse import GcsFuseMount, VolumeMounts
from cloud_run_emulator.gcsfuse_host import is_mounted
from cloud_run_emulator.process import EmulatorProcess

from .conftest import PARENT, _name, _put, _read, create, make_job, poll_execution

# Skipped where FUSE is unavailable; a failure instead under TESTS_REQUIRE_FULL_ENV=1 (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fuse")


def test_reads_go_to_storage_each_time_and_are_counted(mnt, fuse_bucket):
    name = _name()
    fuse_bucket.blob(name).upload_from_string(b"r" * 200_000)  # through the Storage API
    for _ in range(2):
        assert (mnt.mountpoint / name).read_bytes() == b"r" * 200_000
    assert mnt.stats()["bytesRead"][name] == 400_000


def test_reads_through_a_write_handle_and_a_staged_fetch_are_counted(mnt, fuse_bucket):
    name = _name()
    fuse_bucket.blob(name).upload_from_string(b"r" * 100_000)
    with open(mnt.mountpoint / name, "r+b") as f:
        assert len(f.read()) == 100_000
    with open(mnt.mountpoint / name, "r+b") as f:
        f.write(b"w")  # the staged write downloads the object first
    assert mnt.stats()["bytesRead"][name] == 200_000


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
