"""The worker's verifiers on the shared task-folder fixtures (``tests/fixtures/task_folders``):
the committed steps, the newest one and a newer release's record, as each fixture's
``expected.json`` says; reading deletes nothing; a newer record stops a restore; the progress, the
lost steps and the goodput events files read as the next attempt reads them, each goodput file
named and shaped as the worker writes one. The provider's
reader answers the same fixtures in ``tests/unit/test_task_folder_records.py``. Cost: about 1 s."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from gpu_resilience_worker.artifacts import ArtifactCheckpoints
from gpu_resilience_worker.attempt import Attempt
from gpu_resilience_worker.checkpoint import CheckpointConfig, CheckpointManager
from gpu_resilience_worker.commit import CommitStore
from gpu_resilience_worker.config import TaskIdentity
from gpu_resilience_worker.errors import NewerCheckpointError
from gpu_resilience_worker.files import PROGRESS, read_json, record_attempt, reported_step
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.storage import LocalStorage
from gpu_resilience_worker.task_folder import RECORD_SUFFIX, parse_record
from tests.fixtures.task_folders.make_task_folders import differences, fixtures
from tests.worker.test_checkpoint_unit import ListLog

FIXTURES = fixtures()


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _reader(folder: Path, reader: dict, log: ListLog) -> CommitStore | ArtifactCheckpoints:
    logger = StructuredLogger(log)
    if reader["kind"] == "one-file":
        return CommitStore(str(folder), LocalStorage(), logger)
    return ArtifactCheckpoints(folder, prefix=reader["prefix"], suffix=reader["suffix"], logger=logger)


def _answers(store: CommitStore | ArtifactCheckpoints) -> tuple[list[int], dict | None]:
    """:return: the verified steps (newest first) and the newer release's record, as the fixtures write them."""
    valid = []
    for step in store.present_steps():
        try:
            ok, _ = store.verify(step)
        except NewerCheckpointError:
            continue
        if ok:
            valid.append(step)
    newer = store.newer_record()
    fatal = None if newer is None else {"file": os.path.basename(newer.record), "format": newer.format,
                                        "digest": newer.digest}
    return valid, fatal


def test_the_fixtures_are_what_their_script_writes() -> None:
    assert differences() == []


@pytest.mark.parametrize("name, folder, expected", FIXTURES, ids=[f[0] for f in FIXTURES])
def test_the_worker_reads_every_fixture_as_expected(name: str, folder: Path, expected: dict, tmp_path: Path) -> None:
    copy = tmp_path / "task-0"
    shutil.copytree(folder, copy)
    before = _tree(copy)
    log = ListLog()
    store = _reader(copy, expected["reader"], log)
    valid, fatal = _answers(store)
    assert (valid, fatal) == (expected["valid_steps"], expected["fatal"])
    assert (valid[0] if valid else None) == expected["newest_step"]
    if expected["fatal"] is None:
        if expected["reader"]["kind"] == "one-file":
            config = CheckpointConfig(folder=str(copy))
            with CheckpointManager(config, {}, logger=StructuredLogger(log)) as manager:
                assert manager.latest_step() == expected["newest_step"]
        else:
            assert store.latest() == (None if not valid else store.path(expected["newest_step"]))
    assert _tree(copy) == before  # reading a folder deletes and writes nothing


@pytest.mark.parametrize("name, folder, expected", [f for f in FIXTURES if f[2]["fatal"]],
                         ids=[f[0] for f in FIXTURES if f[2]["fatal"]])
def test_a_newer_record_stops_the_restore_and_deletes_nothing(name: str, folder: Path, expected: dict,
                                                              tmp_path: Path) -> None:
    copy = tmp_path / "task-0"
    shutil.copytree(folder, copy)
    before = _tree(copy)
    log = ListLog()
    if expected["reader"]["kind"] == "one-file":
        with CheckpointManager(CheckpointConfig(folder=str(copy)), {}, logger=StructuredLogger(log)) as manager:
            with pytest.raises(NewerCheckpointError) as refused:
                manager.load()
            with pytest.raises(NewerCheckpointError):
                manager.cleanup_stale()
        reason = refused.value.reason
    else:
        store = _reader(copy, expected["reader"], log)
        for call in (store.latest, store.cleanup_uncommitted):
            with pytest.raises(SystemExit) as stopped:
                call()
            assert stopped.value.code == 78
        marker = json.loads((copy / "FATAL").read_text())
        assert marker["exit_code"] == 78 and marker["newer_record"]["digest"] == expected["fatal"]["digest"]
        reason = marker["reason"]
        (copy / "FATAL").unlink()
    assert expected["fatal"]["file"] in reason
    newer = expected["fatal"]["format"] or repr(expected["fatal"]["digest"])
    assert f"has {'format' if expected['fatal']['format'] else 'digest'} {newer}" in reason, reason
    assert _tree(copy) == before


@pytest.mark.parametrize("name, folder, expected", FIXTURES, ids=[f[0] for f in FIXTURES])
def test_the_worker_writes_records_exactly_as_documented(name: str, folder: Path, expected: dict) -> None:
    """Every well-formed format-1 record of the fixtures (written from the README's schema, not by
    the worker) is what the worker's own builder writes for it: the previous release's records
    plus ``"format": 1``, nothing else."""
    for path in sorted(folder.glob(f"*{RECORD_SUFFIX}")):
        try:
            record = parse_record(path.read_bytes())
        except (ValueError, NewerCheckpointError):
            continue
        documented = json.loads(path.read_bytes())
        assert json.loads(record.to_bytes()) == {**documented, "format": 1}, path.name


def _goodput_fields(folder: Path) -> set[str]:
    """:return: the fields of a goodput events file the worker writes (an attempt resumed, stepped, saved, stopped)."""
    attempt = Attempt(LocalStorage(), str(folder), 10, TaskIdentity(execution="w"), StructuredLogger(ListLog()))
    attempt.begin(0, 1.0)
    attempt.stepped(1)
    attempt.saved(0.1)
    attempt.end(143)
    return set(json.loads(Path(attempt.path).read_text()))


@pytest.mark.parametrize("name, folder, expected", FIXTURES, ids=[f[0] for f in FIXTURES])
def test_the_worker_reads_every_fixtures_run_files_as_expected(name: str, folder: Path, expected: dict,
                                                                 tmp_path: Path) -> None:
    copy, storage = tmp_path / "task-0", LocalStorage()
    shutil.copytree(folder, copy)
    progress = read_json(storage, str(copy / PROGRESS))
    answers = {"progress": progress and {"step": reported_step(progress, total_steps=progress["total_steps"]),
                                         "total_steps": progress["total_steps"], "status": progress["status"]}}
    attempts = record_attempt(storage, str(copy), {"execution": "next", "attempt": 0, "task_index": 0,
                                                   "resumed_from_step": 0, "lost_steps": 0})
    reader = Attempt(storage, str(copy), 1, TaskIdentity())
    reader.attempts = attempts
    answers["lost_steps_total"] = reader.lost_steps_total
    fields, answers["goodput"] = _goodput_fields(tmp_path / "writer"), {}
    for path in sorted(folder.glob("goodput-*")):
        events = json.loads(path.read_text())
        assert path.name == Path(Attempt(storage, "", 1, TaskIdentity(execution=events["execution"],
                                                                      task_attempt=events["attempt"])).path).name
        assert "process_start" not in events or set(events) == fields, path  # the previous release's: minimal
        answers["goodput"][f"{events['execution']}-{events['attempt']}"] = events["status"]
    assert answers == {key: expected[key] for key in ("progress", "lost_steps_total", "goodput")}
