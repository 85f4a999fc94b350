"""Unit tests: checkpoint names, keep/save policies, config validation, manager in-process."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from gpu_resilience_worker.checkpoint import (
    AsyncMode,
    COMMIT,
    DATA,
    CheckpointConfig,
    CheckpointManager,
    KeepLatestN,
    RestoreInterrupted,
)
from gpu_resilience_worker.policies import SavePolicy
from gpu_resilience_worker.task_folder import CheckpointName, CommitRecord, ParsedName
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.storage import LocalStorage


@pytest.mark.parametrize(
    ("step", "kind", "name"),
    [
        (0, DATA, "ckpt-00000000.pt"),
        (50, DATA, "ckpt-00000050.pt"),
        (50, COMMIT, "ckpt-00000050.commit.json"),
        (123456789, DATA, "ckpt-123456789.pt"),
    ],
)
def test_name_build_and_parse_round_trip(step: int, kind: str, name: str) -> None:
    assert CheckpointName.build(step, kind) == name
    assert CheckpointName.parse(name) == ParsedName(step, kind, False)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("ckpt-00000050.commit.json.tmp", ParsedName(50, COMMIT, True)),
        ("ckpt-00000050.pt.tmp", ParsedName(50, DATA, True)),
        ("ckpt-0000050.pt", None),  # too few digits
        ("xckpt-00000050.pt", None),  # not anchored at the start
        ("ckpt-00000050.pt.bak", None),  # not anchored at the end
        ("ckpt-00000050.json", None),
        ("old-ckpt-00000050.pt", None),
        ("ckpt-step-50.pt", None),
        ("progress.json", None),
        ("ckpt-00000050.commit.json.tmp.tmp", None),
    ],
)
def test_name_parse_rejects_lookalikes(name: str, expected: ParsedName | None) -> None:
    assert CheckpointName.parse(name) == expected


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_name_build_rejects_bad_steps(bad: object) -> None:
    # The match matters: f"{1.5:08d}" and f"{'3':08d}" raise a ValueError of their own.
    with pytest.raises(ValueError, match=r"step must be a non-negative int, got "):
        CheckpointName.build(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "present", "valid", "deleted"),
    [
        (2, [], [], []),
        (2, [10], [10], []),
        (2, [10, 20], [10, 20], []),
        (2, [10, 20, 30], [10, 20, 30], [10]),
        (3, [10, 20, 30, 40, 50], [10, 20, 30, 40, 50], [10, 20]),
        # an invalid checkpoint between valid ones is purged, the valid ones are kept
        (2, [10, 20, 30, 40], [10, 20, 40], [10, 30]),
        # a newer, invalid (possibly in-flight) checkpoint is never deleted
        (2, [10, 20, 30], [10, 20], []),
        # with no valid checkpoint nothing is deleted
        (2, [10, 20], [], []),
        # the last valid one survives whatever else is present
        (2, [5, 10, 20, 30], [10], [5]),
    ],
)
def test_keep_latest_n(n: int, present: list[int], valid: list[int], deleted: list[int]) -> None:
    assert KeepLatestN(n).to_delete(present, valid) == deleted


@pytest.mark.parametrize(("interval", "step", "expected"), [(50, 0, False), (50, 49, False), (50, 50, True), (50, 100, True), (1, 1, True)])
def test_fixed_interval_policy(interval: int, step: int, expected: bool) -> None:
    assert SavePolicy(steps=interval).should_save(step) is expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keep_latest_k": 1}, "in flight"),
        ({"keep_latest_k": 0}, ">= 2"),
        ({"interval": -1}, "interval"),
        ({"interval_seconds": -1.0}, "seconds"),
        ({"mtbi_seconds": 0.0}, "interruptions"),
        ({"load_step": -2}, "load_step"),
        ({"folder": ""}, "folder"),
    ],
)
def test_checkpoint_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CheckpointConfig(**{"folder": "/tmp/x", **kwargs})


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"[]", "not a JSON object"),
        (b'{"step": 1}', "no valid step or size"),
        # the sha256 check itself: without the match the chunk_bytes check would reject it too
        (b'{"step": 1, "size": 2, "sha256": "xyz"}', "no valid sha256"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_commit_record_rejects_torn_or_malformed(raw: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CommitRecord.from_bytes(raw)


_A, _B = "a" * 64, "b" * 64
_ROOT_AB = __import__("hashlib").sha256(bytes.fromhex(_A) + bytes.fromhex(_B)).hexdigest()


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"chunk_bytes": 0}, "chunk_bytes"),
        ({"chunk_bytes": True}, "chunk_bytes"),
        ({"chunk_bytes": "4096"}, "chunk_bytes"),
        ({"chunk_bytes": 1, "size": 2, "chunks": [_A, _B]}, r"chunk_bytes \(an int >= 4096\)"),  # bounds the work
        ({"chunks": [_A]}, "does not cover 8192 bytes"),  # 8192 bytes at 4096 per chunk need 2 digests
        ({"chunks": [_A, _B, _A]}, "does not cover"),
        ({"chunks": [_A, "xyz"]}, "invalid digest"),
        ({"chunks": [_A, _B.upper()]}, "invalid digest"),
        ({"sha256": _A}, "does not match its hash list"),
        ({"chunks": None}, "does not cover"),
        ({"step": True}, "step or size"),
        ({"size": True}, "step or size"),
        ({"step": -3}, "step or size"),
        ({"size": 8192.0}, "step or size"),
    ],
)
def test_commit_record_rejects_inconsistent_hash_lists(fields: dict, match: str) -> None:
    obj = {"step": 3, "size": 8192, "chunk_bytes": 4096, "chunks": [_A, _B], "sha256": _ROOT_AB, **fields}
    with pytest.raises(ValueError, match=match):
        CommitRecord.from_bytes(json.dumps(obj).encode())


def test_commit_record_nested_too_deep_is_a_value_error() -> None:
    """``json.loads`` raises RecursionError at about 1,000 levels: still just a torn record."""
    raw = ('{"step": 20, "x": ' + "[" * 5000 + "]" * 5000 + "}").encode()
    with pytest.raises(ValueError, match="not valid JSON"):
        CommitRecord.from_bytes(raw)


def test_commit_record_round_trips() -> None:
    listed = CommitRecord.of_chunks(3, 8192, [_A, _B], "now", chunk_bytes=4096)
    assert listed.sha256 == _ROOT_AB and CommitRecord.from_bytes(listed.to_bytes()) == listed


def test_verify_names_the_corrupt_byte_range(tmp_path: Path) -> None:
    box = Box(1.0)
    with _manager(tmp_path, box) as manager:
        manager.save(10)
        manager.save(20)
    data_path, record_path = tmp_path / "ckpt-00000020.pt", tmp_path / "ckpt-00000020.commit.json"
    record = json.loads(record_path.read_text())
    assert record["chunk_bytes"] == 64 << 20 and len(record["chunks"]) == 1
    data = bytearray(data_path.read_bytes())
    data[-1] ^= 0x01
    data_path.write_bytes(bytes(data))
    with _manager(tmp_path, Box()) as manager:
        ok, reason = manager.verify(20)
        assert not ok and reason == f"{record.get('digest', 'sha256')} of bytes 0-{len(data) - 1} does not match the commit record"


class Box:
    """A minimal stateful object."""

    def __init__(self, value: float = 0.0) -> None:
        self.tensor = torch.tensor([value])

    def state_dict(self) -> dict:
        return {"t": self.tensor.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.tensor = state["t"].clone()


class ListLog:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, line: str) -> None:
        if line.strip():
            self.records.append(json.loads(line))

    def flush(self) -> None:
        pass


def _manager(folder: Path, box: Box, stream: ListLog | None = None, keep: int = 2) -> CheckpointManager:
    config = CheckpointConfig(folder=str(folder), interval=10, keep_latest_k=keep, async_mode=AsyncMode.DISABLED)
    return CheckpointManager(config, {"box": box}, logger=StructuredLogger(stream or ListLog()))


def test_manager_save_load_keep_and_fallback(tmp_path: Path) -> None:
    box = Box()
    with _manager(tmp_path, box) as manager:
        assert manager.save(5) is False  # not on the interval
        for step in (10, 20, 30):
            box.tensor += 1
            assert manager.save(step) is True
        assert manager.save(30, force=True) is False  # already saved
        assert manager.valid_steps() == [30, 20]
        assert not (tmp_path / "ckpt-00000010.pt").exists()
    (tmp_path / "ckpt-00000030.pt").write_bytes(b"torn")
    log = ListLog()
    restored = Box()
    with _manager(tmp_path, restored, log) as manager:
        assert manager.latest_step() == 20
        assert manager.load() is True and manager.loaded_step == 20
    assert restored.tensor.item() == 2.0
    warnings = [r for r in log.records if r["severity"] == "WARNING"]
    assert warnings and warnings[0]["file"].endswith("ckpt-00000030.pt")


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the digest can tell
    path.write_bytes(bytes(data))


def test_a_corrupt_checkpoint_found_by_the_restore_is_not_kept_in_place_of_a_valid_one(tmp_path: Path) -> None:
    """keep_latest_k=2 after a fallback past a corrupt newest checkpoint of the right size: the
    valid one restored from stays, the corrupt one is not counted as kept."""
    box = Box()
    with _manager(tmp_path, box) as manager:
        for step in (10, 20):
            box.tensor += 1
            manager.save(step)
    _flip_a_byte(tmp_path / "ckpt-00000020.pt")
    restored = Box()
    with _manager(tmp_path, restored) as manager:
        assert manager.load() is True and manager.loaded_step == 10
        restored.tensor += 1
        manager.save(30, force=True)
        assert manager.valid_steps() == [30, 10]
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".pt") == ["ckpt-00000010.pt", "ckpt-00000030.pt"]


def test_an_unloadable_checkpoint_is_not_kept_in_place_of_a_valid_one(tmp_path: Path) -> None:
    """The same for a checkpoint whose bytes match its record but lack this manager's items."""
    box = Box()
    with _manager(tmp_path, box) as manager:
        manager.save(10)
    config = CheckpointConfig(folder=str(tmp_path), interval=10, keep_latest_k=2, async_mode=AsyncMode.DISABLED)
    with CheckpointManager(config, {"other": Box()}, logger=StructuredLogger(ListLog())) as manager:
        manager.save(20)
    with _manager(tmp_path, Box()) as manager:
        assert manager.load() is True and manager.loaded_step == 10
        manager.save(30, force=True)
        assert manager.valid_steps() == [30, 10]


@pytest.mark.parametrize("stop_after", [0, 1, 3])
def test_a_stop_during_the_restore_raises_and_judges_no_checkpoint(tmp_path: Path, stop_after: int) -> None:
    """``should_stop`` ends a restore (before a candidate, or between its 8 MiB reads) with
    RestoreInterrupted: nothing is loaded, nothing logged as invalid or deleted, and the next
    manager restores the newest checkpoint."""
    box = Box()
    box.tensor = torch.arange(6 << 20, dtype=torch.float32)  # 24 MiB: three reads
    with _manager(tmp_path, box) as manager:
        manager.save(10)
        box.tensor += 1
        manager.save(20)
    asked = []

    def should_stop() -> bool:
        asked.append(1)
        return len(asked) > stop_after

    log = ListLog()
    restored = Box()
    config = CheckpointConfig(folder=str(tmp_path), interval=10, keep_latest_k=2, async_mode=AsyncMode.DISABLED)
    with CheckpointManager(config, {"box": restored}, logger=StructuredLogger(log), should_stop=should_stop) as manager:
        with pytest.raises(RestoreInterrupted) as raised:
            manager.load()
    assert raised.value.step == (None if stop_after == 0 else 20)
    assert manager.loaded_step is None and restored.tensor.numel() == 1
    assert not [r for r in log.records if r["severity"] == "WARNING"], log.records
    again = Box()
    with _manager(tmp_path, again) as manager:
        assert manager.valid_steps() == [20, 10]
        assert manager.load() is True and manager.loaded_step == 20
    assert torch.equal(again.tensor, box.tensor)


def test_manager_cleans_uncommitted_and_temp_files_at_its_first_save(tmp_path: Path) -> None:
    box = Box()
    with _manager(tmp_path, box) as manager:
        manager.save(10)
    (tmp_path / "ckpt-00000020.pt").write_bytes(b"uncommitted")
    (tmp_path / "ckpt-00000020.commit.json.tmp").write_bytes(b"{")
    (tmp_path / "unrelated.txt").write_text("keep me")
    with _manager(tmp_path, Box()) as manager:
        manager.cleanup_stale()  # what the first save does
        assert manager.present_steps() == [10]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000010.commit.json", "ckpt-00000010.pt", "unrelated.txt",
    ]


def test_manager_refuses_unsafe_pickles(tmp_path: Path) -> None:
    """weights_only loading: a checkpoint holding an arbitrary object is skipped, not executed."""
    box = Box()
    with _manager(tmp_path, box) as manager:
        manager.save(10)
    import io

    from gpu_resilience_worker.fastio import chunk_digests

    buffer = io.BytesIO()
    torch.save({"box": {"t": torch.zeros(1)}, "evil": Path("/")}, buffer)
    payload = buffer.getvalue()
    (tmp_path / "ckpt-00000020.pt").write_bytes(payload)
    record = CommitRecord.of_chunks(20, len(payload), chunk_digests(payload), "now")
    (tmp_path / "ckpt-00000020.commit.json").write_bytes(record.to_bytes())
    log = ListLog()
    with _manager(tmp_path, Box(), log) as manager:
        assert manager.load() is True and manager.loaded_step == 10
    assert any("torch.load failed" in r.get("reason", "") for r in log.records)


def test_records_that_do_not_fit_the_data_are_rejected_before_hashing(tmp_path: Path, monkeypatch) -> None:
    """A record whose size differs from the data file is refused on the size alone (no hashing,
    whatever chunk_bytes it claims), and a record nested too deep is a torn record: both are
    skipped with a warning and the previous checkpoint loads."""
    import gpu_resilience_worker.commit as checkpoint

    box = Box(1.0)
    with _manager(tmp_path, box, keep=3) as manager:
        manager.save(10)
        manager.save(20)
        manager.save(30)
    small = "c" * 64
    (tmp_path / "ckpt-00000030.commit.json").write_bytes(
        CommitRecord.of_chunks(30, 4096, [small], "now", chunk_bytes=4096).to_bytes())
    (tmp_path / "ckpt-00000020.commit.json").write_bytes(
        ('{"step": 20, "x": ' + "[" * 5000 + "]" * 5000 + "}").encode())
    hashed = []
    monkeypatch.setattr(checkpoint, "file_chunk_digests", lambda *a: hashed.append(a) or (0, []))
    log = ListLog()
    with _manager(tmp_path, Box(), log) as manager:
        ok, reason = manager.verify(30)
        assert not ok and reason.endswith("commit record says 4096") and not hashed
        monkeypatch.undo()
        assert manager.load() is True and manager.loaded_step == 10
    warned = {r["step"]: r["reason"] for r in log.records if r.get("message") == "skipping invalid checkpoint"}
    assert "commit record says 4096" in warned[30] and "not valid JSON" in warned[20]


class _RecordUnreadable(LocalStorage):
    """Local files, but reading ``ckpt-00000030.commit.json`` fails with EIO while ``failing`` (a
    mount's transient error during the restore)."""

    failing = True

    def open_read(self, path: str):
        if path.endswith("ckpt-00000030.commit.json") and self.failing:
            raise OSError(errno.EIO, "Input/output error", path)
        return super().open_read(path)


def test_retention_never_deletes_a_checkpoint_newer_than_the_one_resumed_from(tmp_path: Path) -> None:
    """The restore could not read the newest record (EIO), skipped it and resumed from 20; that
    checkpoint is valid, and retention after the saves of 40 and 50 (keep 2) leaves it alone (it
    deleted it: work lost to a transient error). Older ones go as usual."""
    box = Box()
    with _manager(tmp_path, box, keep=3) as manager:
        for step in (10, 20, 30):
            box.tensor += 1
            manager.save(step)
    config = CheckpointConfig(folder=str(tmp_path), interval=10, keep_latest_k=2, async_mode=AsyncMode.DISABLED)
    restored, storage = Box(), _RecordUnreadable()
    with CheckpointManager(config, {"box": restored}, storage=storage, logger=StructuredLogger(ListLog())) as manager:
        assert manager.load() is True and manager.loaded_step == 20
        storage.failing = False
        for step in (40, 50):
            manager.save(step, force=True)
        assert manager.valid_steps() == [50, 40, 30]
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == [f"ckpt-000000{s}.pt" for s in (30, 40, 50)]
