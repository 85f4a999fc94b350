"""Renames on the emulator's FUSE volume as in Cloud Storage FUSE: copy then delete, directory renames
(``rename-dir-limit``), a file renamed while open for writing, refused rename flags, a rename on a
full disk, and rewrites of one name within a second recorded as throttled. The mounts and the
helpers are in ``conftest.py``; see ``test_gcsfuse.py`` for the rest.
"""

from __future__ import annotations

import errno
import os
import subprocess

import pytest

from cloud_run_emulator.gcsfuse import GcsFuseMount

from .conftest import _events, _name, _put

# Skipped where FUSE is unavailable; a failure instead under TESTS_REQUIRE_FULL_ENV=1 (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fuse")


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


def test_rewrite_within_a_second_is_recorded_as_throttled(mnt, fuse_bucket):
    name = _name()
    _put(mnt, name, b"one")
    os.unlink(mnt.mountpoint / name)
    _put(mnt, name, b"two")  # a new file again, so it streams: only the rate is wrong
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"two"
    assert len(_events(mnt, name, "throttled-rewrite")) == 1 and _events(mnt, name, "staged") == []


def test_renaming_onto_a_name_written_within_a_second_is_throttled(mnt, fuse_bucket):
    name = _name("progress")
    for i in range(3):
        _put(mnt, f"{name}.tmp", str(i).encode())
        os.rename(mnt.mountpoint / f"{name}.tmp", mnt.mountpoint / name)
    assert fuse_bucket.get_blob(name).download_as_bytes() == b"2"
    assert len(_events(mnt, name, "throttled-rewrite")) == 2
