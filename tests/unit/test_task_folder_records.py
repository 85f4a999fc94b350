"""The provider's reader of commit records (``hooks/progress.py``) on the shared task-folder
fixtures (``tests/fixtures/task_folders``): the committed steps, the newest one, a newer
release's record, the progress, the lost steps and the goodput events files, the same answers the worker gives (``tests/worker/test_task_folder_fixtures.py``).
Pure: a listing of the folder and its files' bytes; the provider imports nothing from the worker."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from airflow_gpu_resilience.commit_records import NewerRecord, TaskCheckpoints, record_commits, task_checkpoints
from airflow_gpu_resilience.hooks.progress import TaskProgress, goodput_events_by_attempt, lost_work_entries
from tests.fixtures.task_folders.make_task_folders import fixtures

FIXTURES = fixtures()


def read_folder(folder: Path, index: int = 0) -> TaskCheckpoints:
    """:return: :func:`task_checkpoints` of ``folder`` as a bucket listing would show it."""
    listing = {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    return task_checkpoints(index, listing, lambda name: (folder / name).read_bytes())


def answers(task: TaskCheckpoints) -> dict:
    """:return: the fixture's answers from the provider's reading."""
    fatal = None if task.newer is None else {"file": task.newer.file, "format": task.newer.format,
                                             "digest": task.newer.digest}
    return {"valid_steps": list(task.steps), "newest_step": task.newest_step, "fatal": fatal}


@pytest.mark.parametrize("name, folder, expected", FIXTURES, ids=[f[0] for f in FIXTURES])
def test_the_provider_reads_every_fixture_as_expected(name: str, folder: Path, expected: dict) -> None:
    task = read_folder(folder)
    assert answers(task) == {key: expected[key] for key in ("valid_steps", "newest_step", "fatal")}
    if task.newer is not None:
        reason = task.newer.reason(0)
        assert reason.startswith(f"task 0: commit record {expected['fatal']['file']} has ")
        assert ("format 99" if expected["fatal"]["format"] else "digest 'blake9'") in reason


def run_answers(folder: Path) -> dict:
    """:return: the fixture's progress, lost steps (``metrics.json``, else ``attempts.json``, as
    :meth:`CheckpointFilesHook.lost_work` reads them) and goodput events as the provider reads them."""
    def read(name: str):
        return json.loads((folder / name).read_text()) if (folder / name).is_file() else None

    progress = TaskProgress.from_json(0, read("progress.json"))
    total = None if progress is None else progress.total_steps
    metrics = read("metrics.json")
    lost = lost_work_entries(0, metrics if isinstance(metrics, dict) else read("attempts.json"), total)
    goodput = goodput_events_by_attempt(read(p.name) for p in sorted(folder.glob("goodput-*")))
    return {"progress": progress and {"step": progress.step, "total_steps": total, "status": progress.status},
            "lost_steps_total": sum(entry["lost_steps"] for entry in lost),
            "goodput": {f"{execution}-{attempt}": events["status"] for (execution, attempt), events in goodput.items()}}


@pytest.mark.parametrize("name, folder, expected", FIXTURES, ids=[f[0] for f in FIXTURES])
def test_the_provider_reads_every_fixtures_run_files_as_expected(name: str, folder: Path, expected: dict) -> None:
    assert run_answers(folder) == {key: expected[key] for key in ("progress", "lost_steps_total", "goodput")}


def _root(*digests: bytes) -> bytes:
    """The sha256 of the concatenated binary digests (the record's ``sha256``, in binary)."""
    return hashlib.sha256(b"".join(digests)).digest()


_ONE = {"step": 20, "size": 5, "sha256": _root(bytes(4)).hex(), "chunk_bytes": 4096, "chunks": ["0" * 8],
        "digest": "crc32"}
_FOLDER = {"step": 8, "name": "checkpoint-8", "sha256": _root(_root(bytes(32))).hex(),
           "files": [{"path": "checkpoint-8/a.bin", "size": 3, "chunk_bytes": 4096, "chunks": ["0" * 64]}]}


def _raw(base: dict, **fields) -> bytes:
    return json.dumps({**base, **fields}).encode()


#: (record, its name in the task folder, what it commits, a NewerRecord, or None)
RECORDS = {
    "one file": (_raw(_ONE), "ckpt-00000020.commit.json", (20, {"ckpt-00000020.pt": 5})),
    "one file, format 1": (_raw(_ONE, format=1), "ckpt-00000020.commit.json", (20, {"ckpt-00000020.pt": 5})),
    "one file without a hash list (the worker cannot verify it)": (
        b'{"step": 40, "size": 16, "sha256": "ab"}', "ckpt-00000040.commit.json", None),
    "another root digest than its hash list's": (_raw(_ONE, sha256="f" * 64), "ckpt-00000020.commit.json", None),
    "a chunk size below 4 KiB (hash list and root consistent)": (
        _raw(_ONE, chunk_bytes=1, chunks=["0" * 8] * 5, sha256=_root(bytes(20)).hex()), "ckpt-00000020.commit.json",
        None),
    "a chunk size of 4 KiB (hash list and root consistent)": (
        _raw(_ONE, size=4097, chunks=["0" * 8] * 2, sha256=_root(bytes(8)).hex()), "ckpt-00000020.commit.json",
        (20, {"ckpt-00000020.pt": 4097})),
    "a digest of another width": (_raw(_ONE, chunks=["0" * 64]), "ckpt-00000020.commit.json", None),
    "a folder's file with another root": (_raw(_FOLDER, sha256=_root(bytes(32)).hex()), "checkpoint-8.commit.json",
                                          None),
    "folder": (_raw(_FOLDER), "checkpoint-8.commit.json", (8, {"checkpoint-8/a.bin": 3})),
    "format 99": (_raw(_ONE, format=99), "ckpt-00000020.commit.json", NewerRecord("ckpt-00000020.commit.json", 99)),
    "format 99, nothing else known": (b'{"format": 99}', "x.commit.json", NewerRecord("x.commit.json", 99)),
    "digest blake9": (_raw(_ONE, digest="blake9"), "ckpt-00000020.commit.json",
                      NewerRecord("ckpt-00000020.commit.json", digest="blake9")),
    "a folder's file with digest blake9": (
        _raw(_FOLDER, files=[{**_FOLDER["files"][0], "digest": "blake9"}]), "checkpoint-8.commit.json",
        NewerRecord("checkpoint-8.commit.json", digest="blake9")),
    "format as a string": (_raw(_ONE, format="2"), "ckpt-00000020.commit.json", None),
    "digest not a string": (_raw(_ONE, digest=7), "ckpt-00000020.commit.json", None),
    "torn": (_raw(_ONE)[:25], "ckpt-00000020.commit.json", None),
    "another step than its name": (_raw(_ONE), "ckpt-00000021.commit.json", None),
    "one file under another name": (_raw(_ONE), "model.commit.json", None),
    "no sha256": (_raw(_ONE, sha256=None), "ckpt-00000020.commit.json", None),
    "folder under another name": (_raw(_FOLDER), "checkpoint-9.commit.json", None),
    "folder, a path out of it": (_raw(_FOLDER, files=[{"path": "../x", "size": 1}]), "checkpoint-8.commit.json", None),
    "folder, another checkpoint's file": (
        _raw(_FOLDER, files=[{"path": "checkpoint-80/a", "size": 1}]), "checkpoint-8.commit.json", None),
    "folder, no files": (_raw(_FOLDER, files=[]), "checkpoint-8.commit.json", None),
    "folder, a size missing": (_raw(_FOLDER, files=[{"path": "checkpoint-8/a"}]), "checkpoint-8.commit.json", None),
    "not an object": (b"[]", "ckpt-00000020.commit.json", None),
}


@pytest.mark.parametrize("raw, name, commits", RECORDS.values(), ids=RECORDS.keys())
def test_record_commits(raw: bytes, name: str, commits) -> None:
    assert record_commits(raw, name) == commits


def test_a_record_counts_only_when_every_file_is_listed_at_its_size() -> None:
    record = _raw(_FOLDER)
    read = {"checkpoint-8.commit.json": record}.get
    assert task_checkpoints(3, {"checkpoint-8.commit.json": 1, "checkpoint-8/a.bin": 3}, read).steps == (8,)
    assert task_checkpoints(3, {"checkpoint-8.commit.json": 1, "checkpoint-8/a.bin": 4}, read).steps == ()
    assert task_checkpoints(3, {"checkpoint-8.commit.json": 1}, read).newest_step is None
    gone = task_checkpoints(3, {"checkpoint-8.commit.json": 1, "checkpoint-8/a.bin": 3}, lambda name: None)
    assert gone == TaskCheckpoints(3)  # pruned by the worker since the listing
