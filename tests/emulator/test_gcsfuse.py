"""The emulator's FUSE volume against Cloud Storage FUSE's documented semantics: what becomes an
object and when, and what falls back to staged writes (``EIO`` in strict mode): overwrites,
truncation, out-of-order writes, reads while writing, the streaming limit, killed writers, a
child's close of an inherited descriptor, unlinked files. Renames are in ``test_gcsfuse_rename.py``,
several writers of one object in ``test_gcsfuse_writers.py``, the mounts themselves (bytes read,
lifecycle, options, the folder fallback) in ``test_gcsfuse_mounts.py``.

See :mod:`cloud_run_emulator.gcsfuse` for the semantics. Objects are checked through the real
google-cloud-storage client on the emulator's GCS endpoint; the mounts (``mnt``, ``strict``)
and their bucket are shared fixtures (``conftest.py``).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from cloud_run_emulator.gcsfuse_rules import DEFAULT_STREAMING_FILES

from .conftest import _events, _name, _put

# Skipped where FUSE is unavailable; a failure instead under TESTS_REQUIRE_FULL_ENV=1 (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fuse")


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


def test_killed_writer_leaves_a_short_object(mnt, fuse_bucket):
    name = _name()
    script = ("import os,signal,sys\nf=open(sys.argv[1],'wb',buffering=0)\n"
              "f.write(b'z'*(1<<20)); os.kill(os.getpid(), signal.SIGKILL); f.write(b'never')\n")
    proc = subprocess.run([sys.executable, "-c", script, str(mnt.mountpoint / name)], check=False)
    assert proc.returncode == -signal.SIGKILL
    blob = fuse_bucket.get_blob(name)  # the kernel closed the file: finalized as it was
    assert blob is not None and blob.size == 1 << 20


def test_more_files_streaming_at_once_than_the_limit_fall_back_to_staging(mnt, fuse_bucket):
    names = [_name("many") for _ in range(DEFAULT_STREAMING_FILES + 1)]
    files = [open(mnt.mountpoint / name, "wb", buffering=0) for name in names]
    for f in files:
        f.write(b"abc")
    for f in files:
        f.close()
    assert [e["cause"] for name in names for e in _events(mnt, name, "staged")] == ["streaming-limit"]
    assert _events(mnt, names[-1], "staged") and all(fuse_bucket.get_blob(n).size == 3 for n in names)


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


def test_a_deleted_file_is_not_uploaded_by_a_read_or_fsync(mnt, fuse_bucket):
    name = _name()
    fd = os.open(mnt.mountpoint / name, os.O_RDWR | os.O_CREAT)
    os.write(fd, b"gone")
    os.unlink(mnt.mountpoint / name)
    os.pread(fd, 4, 0)
    os.fsync(fd)
    os.close(fd)
    assert fuse_bucket.get_blob(name) is None


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
