"""Bad input through ``gpu_resilience_trainer.__main__.main`` in this process (no process start per case):
ONE clear error line, the sysexits code, existing checkpoints untouched."""

from __future__ import annotations

import errno
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_resilience_trainer import __main__ as cli
from gpu_resilience_trainer.data import load_dataset
from gpu_resilience_worker.checkpoint import AsyncMode, CheckpointConfig, CheckpointManager
from gpu_resilience_worker.task_folder import CommitRecord
from gpu_resilience_worker.fastio import chunk_digests
from gpu_resilience_worker.commit import CommitStore
from gpu_resilience_worker.errors import DataError, NewerCheckpointError, OutOfSpaceError
from gpu_resilience_worker.fatal import fatal_marker_code, free_bytes, invocation, space_came_back, write_fatal
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.storage import LocalStorage

from tests.worker.test_checkpoint_unit import Box, ListLog

ENV = {"CLOUD_RUN_JOB": "job", "CLOUD_RUN_TASK_INDEX": "0", "CLOUD_RUN_TASK_COUNT": "1"}


def _existing_checkpoint(namespace: Path) -> dict[str, bytes]:
    config = CheckpointConfig(folder=str(namespace), interval=10, async_mode=AsyncMode.DISABLED)
    with CheckpointManager(config, {"box": Box(1.0)}, logger=StructuredLogger(ListLog())) as manager:
        manager.save(10)
    return {p.name: p.read_bytes() for p in namespace.iterdir()}


def _run(capsys, root: Path, data: Path, *extra: str, env: dict | None = None) -> tuple[int, list[dict]]:
    argv = ["train", "--checkpoint-dir", str(root), "--data", str(data), "--steps", "5", *extra]
    code = cli.main(argv, {**ENV, **(env or {})})
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    return code, [r for r in lines if r["severity"] == "ERROR"]


#: case -> (extra flags, environment) of the rows a breaker found
BREAKER_CASES = {
    "task timeout 0": ([], {"TASK_TIMEOUT_SECONDS": "0"}),
    "task timeout inf": ([], {"TASK_TIMEOUT_SECONDS": "inf"}),
    "grace inf": ([], {"PREEMPTION_GRACE_SECONDS": "inf"}),
    "grace 1e300": ([], {"PREEMPTION_GRACE_SECONDS": "1e300"}),
    "execution outside": ([], {"CLOUD_RUN_EXECUTION": "../../escaped"}),
    "threads 100000": (["--threads", "100000"], {}),
    "interval infs": (["--checkpoint-interval", "infs"], {}),
    "mtbi inf": (["--mtbi", "inf"], {}),
    "progress interval inf": (["--progress-interval", "inf"], {}),
    "empty run id": (["--run-id", ""], {}),
}


@pytest.mark.parametrize(
    ("case", "code", "reason"),
    [
        ("missing data file", 65, "cannot open"),
        ("wrong shape", 65, "shape"),
        ("not an npz", 65, "cannot read"),
        ("unknown option", 78, "unrecognized arguments: --bogus"),
        ("bad value", 78, "--steps"),
        ("bad environment", 78, "PREEMPTION_GRACE_SECONDS"),
        ("unwritable checkpoint dir", 73, "not writable"),
        # found by a breaker: each of these ran into a crash (exit 1, or SIGSEGV) on every retry,
        # wrote outside the task folder, or never saved
        ("task timeout 0", 78, "TASK_TIMEOUT_SECONDS='0' must be a number of seconds > 0 and <= 604800"),
        ("task timeout inf", 78, "TASK_TIMEOUT_SECONDS='inf'"),
        ("grace inf", 78, "PREEMPTION_GRACE_SECONDS='inf' must be a number of seconds >= 0 and <= 604800"),
        ("grace 1e300", 78, "PREEMPTION_GRACE_SECONDS='1e300'"),
        ("execution outside", 78, "CLOUD_RUN_EXECUTION '../../escaped' is not a safe path component"),
        ("threads 100000", 78, "--threads must be in [1, 1024], got 100000"),
        ("interval infs", 78, "--checkpoint-interval 'infs'"),
        ("mtbi inf", 78, "--mtbi (mean time between interruptions) must be a finite number"),
        ("progress interval inf", 78, "--progress-interval must be in [0, 604800] seconds"),
        ("empty run id", 78, "--run-id is empty"),
    ],
)
def test_bad_input_one_error_line_sysexits_code_checkpoints_untouched(
    capsys, monkeypatch, tmp_path: Path, digits_npz: Path, case: str, code: int, reason: str
) -> None:
    root, data, extra, env = tmp_path / "ckpt", digits_npz, [], {}
    namespace = root / "job" / "task-0"
    before = _existing_checkpoint(namespace)
    if case == "missing data file":
        data = tmp_path / "nowhere.npz"
    elif case == "wrong shape":
        data = tmp_path / "flat.npz"
        np.savez(data, x_train=np.ones(8, np.float32), y_train=np.zeros(8, np.int64),
                 x_test=np.ones((2, 4), np.float32), y_test=np.zeros(2, np.int64))
    elif case == "not an npz":
        data = tmp_path / "bad.npz"
        data.write_bytes(b"this is not an npz file")
    elif case == "unknown option":
        extra = ["--bogus"]
    elif case == "bad value":
        extra = ["--steps", "0"]
    elif case == "bad environment":
        env = {"PREEMPTION_GRACE_SECONDS": "soon"}
    elif case in BREAKER_CASES:
        extra, env = BREAKER_CASES[case]
    else:  # root ignores file modes: refuse the probe write as a read-only mount would
        real_write = LocalStorage.write

        def refuse(self, path, payload, *, atomic=False):
            if path.endswith(".write-probe"):
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return real_write(self, path, payload, atomic=atomic)

        monkeypatch.setattr(LocalStorage, "write", refuse)
    exit_code, errors = _run(capsys, root, data, *extra, env=env)
    assert exit_code == code
    assert len(errors) == 1 and reason in errors[0]["message"], errors
    after = {p.name: p.read_bytes() for p in namespace.iterdir() if p.name != "FATAL"}
    assert after == before
    # a writable namespace holds the marker: the same invocation exits at once (not where the
    # task identity or a namespace flag itself is bad: the namespace is not known)
    if code != 73 and case not in ("execution outside", "empty run id"):
        assert json.loads((namespace / "FATAL").read_text())["exit_code"] == code
        assert _run(capsys, root, data, *extra, env=env)[0] == code


def test_checkpoint_root_that_is_a_file_exits_73(capsys, tmp_path: Path, digits_npz: Path) -> None:
    root = tmp_path / "a-file"
    root.write_text("not a folder")
    exit_code, errors = _run(capsys, root, digits_npz)
    assert exit_code == 73 and len(errors) == 1 and "not writable" in errors[0]["message"]
    assert errors[0]["fatal_marker"].startswith("not written")


def test_transient_read_error_is_retryable_missing_file_is_not(monkeypatch, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="cannot open"):
        load_dataset(str(tmp_path / "missing.npz"))

    def eio(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(np, "load", eio)
    with pytest.raises(OSError) as raised:
        load_dataset(str(tmp_path / "any.npz"))
    assert not isinstance(raised.value, DataError)  # exit 1, retried; no FATAL marker


class _Exploit:
    """Pickles to ``open(marker, "w")``: a full unpickler would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_pickled_payload_is_refused_not_executed(tmp_path: Path) -> None:
    folder, marker = tmp_path / "ns", tmp_path / "executed"
    config = CheckpointConfig(folder=str(folder), interval=10, async_mode=AsyncMode.DISABLED)
    with CheckpointManager(config, {"box": Box(2.0)}, logger=StructuredLogger(ListLog())) as manager:
        manager.save(10)
    buffer = io.BytesIO()
    torch.save({"box": {"t": torch.zeros(1)}, "evil": _Exploit(marker)}, buffer)
    payload = buffer.getvalue()
    (folder / "ckpt-00000020.pt").write_bytes(payload)
    record = CommitRecord.of_chunks(20, len(payload), chunk_digests(payload), "now")
    (folder / "ckpt-00000020.commit.json").write_bytes(record.to_bytes())
    log, restored = ListLog(), Box()
    with CheckpointManager(config, {"box": restored}, logger=StructuredLogger(log)) as manager:
        assert manager.load() and manager.loaded_step == 10
    assert not marker.exists() and restored.tensor.item() == 2.0
    skipped = [r for r in log.records if r["message"] == "skipping invalid checkpoint"]
    assert skipped[0]["step"] == 20 and "torch.load failed" in skipped[0]["reason"]


def test_a_write_probe_that_fails_half_way_is_not_left_behind(tmp_path: Path, monkeypatch) -> None:
    """A full disk: the probe's file is created, its write fails with ENOSPC; the error stays
    retryable (an OSError, not OutputError) and the probe's file is removed."""
    from gpu_resilience_worker.fatal import check_writable

    def full(self, path, data, *, atomic=False):
        Path(path).write_bytes(b"pr")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LocalStorage, "write", full)
    with pytest.raises(OSError) as raised:
        check_writable(str(tmp_path / "ns"))
    assert raised.value.errno == errno.ENOSPC
    assert list((tmp_path / "ns").iterdir()) == []


def test_an_empty_checkpoint_dir_is_refused_without_writing_to_the_default_root(capsys, tmp_path: Path,
                                                                               digits_npz: Path) -> None:
    """``--checkpoint-dir ''`` (a template that rendered empty) used to train under /checkpoints."""
    code = cli.main(["train", "--checkpoint-dir", "", "--data", str(digits_npz), "--steps", "5"], ENV)
    errors = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"ERROR"' in line]
    assert code == 78 and len(errors) == 1 and "--checkpoint-dir is empty" in errors[0]["message"]
    assert errors[0]["fatal_marker"] == "not written: no namespace"


@pytest.mark.parametrize("name", ["ckpt-00000005.pt", "ckpt-00000005.commit.json", "ckpt-00000005.pt.tmp",
                                  "metrics.json", "progress.json", "attempts.json", ".write-probe", "FATAL"])
def test_a_folder_named_like_a_worker_file_exits_73_at_once_and_is_checked_again_next_time(
    capsys, tmp_path: Path, digits_npz: Path, name: str
) -> None:
    """A folder with one of the worker's file names (step 5 is the final step here) failed the
    final save, or the probe, on every attempt with exit 1: now one error naming it, exit 73
    before any training, the folder and its contents untouched; once it is removed, the next
    attempt trains (the marker of a 73 does not outlive the cause)."""
    root = tmp_path / "ckpt"
    blocker = root / "job" / "task-0" / name
    blocker.mkdir(parents=True)
    (blocker / "user-file").write_text("keep me")
    exit_code, errors = _run(capsys, root, digits_npz)
    assert exit_code == 73 and len(errors) == 1, errors
    assert f"folders named like the worker's own files ({name})" in errors[0]["message"]
    assert (blocker / "user-file").read_text() == "keep me"
    assert not any(p.name.startswith("ckpt-") for p in blocker.parent.iterdir() if p != blocker)
    (blocker / "user-file").unlink()
    blocker.rmdir()
    assert _run(capsys, root, digits_npz)[0] == 0


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"reason": "no exit code"}'])
def test_an_unreadable_fatal_marker_is_removed_not_obeyed(capsys, tmp_path: Path, digits_npz: Path,
                                                          content: bytes) -> None:
    """Markers are written whole; an empty or garbled one made every attempt exit 78."""
    namespace = tmp_path / "ckpt" / "job" / "task-0"
    namespace.mkdir(parents=True)
    (namespace / "FATAL").write_bytes(content)
    assert _run(capsys, tmp_path / "ckpt", digits_npz)[0] == 0
    assert not (namespace / "FATAL").exists()


@pytest.mark.parametrize(("recorded", "now", "came_back"), [
    (4096, 8192, True),
    (4096, 4096, False),  # nothing freed (or a volume whose figure never changes): obeyed
    (8192, 4096, False),  # fuller still (the marker itself took a block)
    (None, 8192, False),  # a marker that recorded no figure: obeyed
    (4096, None, False),  # no figure now (statvfs failed): obeyed
    ("4096", 8192, False),  # not a count: obeyed
    (True, 8192, False),
])
def test_a_full_disk_marker_holds_until_more_space_is_free(recorded, now, came_back: bool) -> None:
    assert space_came_back(recorded, now) is came_back


def test_a_full_disk_marker_is_obeyed_until_space_is_freed(tmp_path: Path) -> None:
    """``FATAL`` of exit 74 records the folder's free bytes; the same invocation exits at once with
    74 while no more is free, and goes on (the marker removed) once more is."""
    log, called_as = ListLog(), invocation(["train"])
    error = OutOfSpaceError(f"checkpoint folder {tmp_path} has no room for a checkpoint: No space left on device")
    assert write_fatal(str(tmp_path), error, StructuredLogger(log), called_as) == 74
    marker = json.loads((tmp_path / "FATAL").read_text())
    assert marker["exit_code"] == 74 and isinstance(marker["free_bytes"], int)
    marker["free_bytes"] = free_bytes(str(tmp_path)) + (1 << 40)  # as if the disk had more room then
    (tmp_path / "FATAL").write_text(json.dumps(marker))
    assert fatal_marker_code(str(tmp_path), StructuredLogger(log), called_as) == 74
    marker["free_bytes"] = 0  # the disk was full then; it has room now
    (tmp_path / "FATAL").write_text(json.dumps(marker))
    assert fatal_marker_code(str(tmp_path), StructuredLogger(log), called_as) is None
    assert not (tmp_path / "FATAL").exists()


def test_a_newer_record_marker_holds_while_the_record_is_unreadable_here(tmp_path: Path) -> None:
    """``FATAL`` of a newer release's commit record names it; the same invocation exits at once
    with 78 while that record still has the newer format, and goes on (the marker removed) once
    it is readable (the newer release that reads it runs) or gone (moved out by hand)."""
    log, called_as = ListLog(), invocation(["train"])
    _existing_checkpoint(tmp_path)
    record = tmp_path / "ckpt-00000010.commit.json"
    original = record.read_bytes()
    record.write_bytes(original.replace(b'"format": 1', b'"format": 99'))
    with pytest.raises(NewerCheckpointError) as refused:
        CommitStore(str(tmp_path), LocalStorage(), StructuredLogger(log)).refuse_newer_records()
    assert write_fatal(str(tmp_path), refused.value, StructuredLogger(log), called_as) == 78
    marker = json.loads((tmp_path / "FATAL").read_text())
    assert marker["newer_record"] == {"file": str(record), "format": 99, "digest": None}
    assert str(record) in marker["reason"] and "format 99" in marker["reason"]
    assert fatal_marker_code(str(tmp_path), StructuredLogger(log), called_as) == 78
    record.unlink()
    record.write_bytes(original)  # what a release that reads format 99 would see: a readable record
    assert fatal_marker_code(str(tmp_path), StructuredLogger(log), called_as) is None
    assert not (tmp_path / "FATAL").exists()
