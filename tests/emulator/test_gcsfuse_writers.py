"""Several writers of one object on the emulator's FUSE volume: two mounts or two tasks (the second
close gets ``ESTALE``), the handles of one task sharing its file, another task's writes invisible
until closed, and the streaming limit counted per task. The mounts and the helpers are in
``conftest.py``; see ``test_gcsfuse.py`` for the rest.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from .conftest import _events, _mount, _name, _put

# Skipped where FUSE is unavailable; a failure instead under TESTS_REQUIRE_FULL_ENV=1 (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fuse")


@pytest.fixture(scope="module")
def other_mnt(emulator, fuse_bucket):
    """A second mount of the same bucket (another machine's view of it)."""
    with _mount(emulator, fuse_bucket, strict=False, name="other") as mount:
        yield mount


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
