"""Unit tests: the rules the worker keeps so that a Cloud Storage FUSE volume never stages a
write and a restore downloads a checkpoint once (in-process, about 3 s in all).

- every save writes new files (an existing name is deleted first, never truncated in place);
- the commit record follows only a successful ``close()`` of the data;
- a restore reads the checkpoint's bytes once, through :meth:`Storage.open_read`, and loads the
  verified copy; retention after a save reads no checkpoint data;
- a killed writer's short data file (a finalized short object) is never a valid checkpoint;
- records of the old format (sha256 chunks, no ``digest`` field) still load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch

from gpu_resilience_worker.checkpoint import AsyncMode, CheckpointConfig, CheckpointManager, CheckpointSaveError
from gpu_resilience_worker.task_folder import CommitRecord
from gpu_resilience_worker.fastio import DIGESTS, chunk_digests, crc32c_available, default_digest
from gpu_resilience_worker.restore_copy import LocalCopy
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.storage import LocalStorage
from gpu_resilience_worker.errors import NewerCheckpointError
from tests.conftest import missing_from_env
from tests.worker.test_checkpoint_unit import Box, ListLog

#: A skip without it; a failure under TESTS_REQUIRE_FULL_ENV=1 (tests/conftest.py).
CRC32C_INSTALL = "make venv (google-cloud-storage, a requirement of the provider, brings it)"


class _CountingReader:
    def __init__(self, handle: BinaryIO, counts: dict[str, int], name: str) -> None:
        self._handle, self._counts, self._name = handle, counts, name

    def readinto(self, buffer: Any) -> int:
        count = self._handle.readinto(buffer) or 0
        self._counts[self._name] = self._counts.get(self._name, 0) + count
        return count

    def read(self, size: int = -1) -> bytes:
        data = self._handle.read(size)
        self._counts[self._name] = self._counts.get(self._name, 0) + len(data)
        return data

    def __enter__(self) -> _CountingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()


class CountingStorage(LocalStorage):
    """Local storage that counts the bytes read of each file name, and offers no local path
    (as a storage whose every byte costs a download)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def open_read(self, path: str) -> BinaryIO:
        return _CountingReader(super().open_read(path), self.counts, os.path.basename(path))  # type: ignore[return-value]

    def read(self, path: str) -> bytes:
        data = super().read(path)
        name = os.path.basename(path)
        self.counts[name] = self.counts.get(name, 0) + len(data)
        return data

    def local_path(self, path: str) -> None:  # type: ignore[override]
        return None

    def data_bytes(self) -> int:
        return sum(n for name, n in self.counts.items() if name.endswith(".pt"))


def _manager(folder: Path, box: Box, storage: Any = None, keep: int = 3,
             log: ListLog | None = None) -> CheckpointManager:
    config = CheckpointConfig(folder=str(folder), interval=10, keep_latest_k=keep, async_mode=AsyncMode.DISABLED)
    return CheckpointManager(config, {"box": box}, storage=storage, logger=StructuredLogger(log or ListLog()))


def test_restore_reads_the_checkpoint_bytes_once_and_retention_reads_none(tmp_path: Path) -> None:
    """Old code hashed the file and then read it again for torch.load (2x), and re-verified
    every kept checkpoint after each save."""
    box = Box()
    with _manager(tmp_path, box) as manager:
        for step in (10, 20, 30):
            box.tensor = torch.randn(1 << 16)
            manager.save(step)
    size = (tmp_path / "ckpt-00000030.pt").stat().st_size
    storage, restored = CountingStorage(), Box()
    with _manager(tmp_path, restored, storage) as manager:
        assert manager.load() and manager.loaded_step == 30
        assert storage.data_bytes() == size  # one read of one checkpoint
        assert torch.equal(restored.tensor, box.tensor)
        manager.save(40)  # retention (keep 3) decides on records and sizes, reads no data
        assert storage.data_bytes() == size
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["ckpt-00000020.pt", "ckpt-00000030.pt", "ckpt-00000040.pt"]


def test_a_save_never_truncates_an_existing_file(tmp_path: Path) -> None:
    """Re-saving a step (a resume from an older checkpoint) and every temporary name write new
    files: a hard link to the old file keeps the old bytes. Old code truncated in place."""
    box = Box(1.0)
    with _manager(tmp_path, box) as manager:
        manager.save(10)
        manager.save(20)
    os.link(tmp_path / "ckpt-00000020.pt", tmp_path / "old-data")
    old = (tmp_path / "old-data").read_bytes()
    (tmp_path / "progress.json.tmp").write_bytes(b"left by a killed attempt")
    os.link(tmp_path / "progress.json.tmp", tmp_path / "old-tmp")
    box.tensor = torch.tensor([5.0])
    with _manager(tmp_path, box) as manager:
        assert manager.load(10)
        box.tensor = torch.tensor([7.0])
        assert manager.save(20)
    LocalStorage().write(str(tmp_path / "progress.json"), b"{}", atomic=True)
    assert (tmp_path / "old-data").read_bytes() == old
    assert (tmp_path / "old-tmp").read_bytes() == b"left by a killed attempt"
    assert (tmp_path / "ckpt-00000020.pt").read_bytes() != old


class _FailingClose(LocalStorage):
    """Local storage whose data files fail at ``close()`` (a Cloud Storage upload error)."""

    def write(self, path: str, data: Any, *, atomic: bool = False) -> None:
        if not path.endswith(".pt"):
            return super().write(path, data, atomic=atomic)

        def failing(handle: BinaryIO) -> None:
            data(handle)
            raise OSError(5, "Input/output error (upload failed at close)")

        return super().write(path, failing, atomic=atomic)


def test_no_commit_record_when_the_data_close_fails(tmp_path: Path) -> None:
    box = Box(1.0)
    with _manager(tmp_path, box) as manager:
        manager.save(10)
    with _manager(tmp_path, box, _FailingClose()) as manager:
        with pytest.raises(CheckpointSaveError, match="upload failed"):
            manager.save(20)
    assert not (tmp_path / "ckpt-00000020.commit.json").exists()
    with _manager(tmp_path, Box()) as manager:
        assert manager.load() and manager.loaded_step == 10


@pytest.mark.parametrize("with_record", [False, True])
def test_a_killed_writers_short_object_is_never_a_valid_checkpoint(tmp_path: Path, with_record: bool) -> None:
    """A writer killed inside a save leaves a short, finalized data file (Cloud Storage FUSE
    closes it at the kill): with no record, or with a record that claims the full size, it is
    never loaded (with a record: skipped with a warning), the previous checkpoint loads, and the next writer removes it."""
    box = Box()
    with _manager(tmp_path, box) as manager:
        box.tensor = torch.randn(1 << 14)
        manager.save(10)
        kept = box.tensor.clone()
        box.tensor = torch.randn(1 << 14)
        manager.save(20)
    data, record = tmp_path / "ckpt-00000020.pt", tmp_path / "ckpt-00000020.commit.json"
    full = data.read_bytes()
    data.unlink()
    data.write_bytes(full[: len(full) // 2])
    if not with_record:
        record.unlink()
    log, restored = ListLog(), Box()
    with _manager(tmp_path, restored, log=log) as manager:
        assert manager.latest_step() == 10
        assert manager.load() and manager.loaded_step == 10
        assert torch.equal(restored.tensor, kept)
        if not with_record:
            manager.cleanup_stale()
    warned = [r for r in log.records if r.get("message") == "skipping invalid checkpoint"]
    if with_record:  # an uncommitted file is no candidate at all
        assert [r["step"] for r in warned] == [20] and "commit record says" in warned[0]["reason"]
    else:
        assert warned == []
    assert data.exists() is with_record  # uncommitted data is stale: removed by the writer


@pytest.mark.parametrize("digest", DIGESTS)
def test_every_digest_round_trips_and_old_sha256_records_load(tmp_path: Path, digest: str) -> None:
    if digest == "crc32c" and not crc32c_available():
        missing_from_env("google-crc32c with its C implementation is not importable", CRC32C_INSTALL)
    box = Box()
    box.tensor = torch.randn(1 << 14)
    with _manager(tmp_path, box) as manager:
        manager.digest = digest
        manager.save(10)
    record = json.loads((tmp_path / "ckpt-00000010.commit.json").read_text())
    assert record.get("digest", "sha256") == digest and ("digest" in record) == (digest != "sha256")
    payload = (tmp_path / "ckpt-00000010.pt").read_bytes()
    assert record["chunks"] == chunk_digests(payload, record["chunk_bytes"], digest)
    restored = Box()
    with _manager(tmp_path, restored, CountingStorage()) as manager:
        assert manager.load() and torch.equal(restored.tensor, box.tensor)
        ok, _ = manager.verify(10)
        assert ok
    corrupt = bytearray(payload)
    corrupt[len(corrupt) // 2] ^= 0x10
    (tmp_path / "ckpt-00000010.pt").write_bytes(bytes(corrupt))
    with _manager(tmp_path, Box()) as manager:
        assert not manager.load()
        assert manager.verify(10) == (False, f"{digest} of bytes 0-{len(payload) - 1} does not match the commit record")


def test_new_checkpoints_use_the_cheaper_digest() -> None:
    assert default_digest() == ("crc32c" if crc32c_available() else "crc32")
    record = CommitRecord.of_chunks(1, 5, chunk_digests(b"hello", 4096, "crc32"), "now", 4096, "crc32")
    assert CommitRecord.from_bytes(record.to_bytes()) == record
    with pytest.raises(ValueError, match="invalid digest"):  # a sha256-sized digest in a crc32 record
        CommitRecord.from_bytes(record.to_bytes().replace(record.data.chunks[0].encode(), b"a" * 64))
    with pytest.raises(NewerCheckpointError, match="digest 'md5'"):  # a digest not known here: a newer release's
        CommitRecord.from_bytes(record.to_bytes().replace(b'"crc32"', b'"md5"'))


def test_local_copy_counts_a_longer_file_and_frees_on_close(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10_000)
    with LocalCopy(9_000) as copy, open(path, "rb", buffering=0) as handle:
        size, digests = copy.fill(handle, 4096, "crc32")
        assert size == 9_001 and len(digests) == 3  # one byte past the expected size is read
    copy.close()
    with pytest.raises(ValueError, match="size must be >= 0"):
        LocalCopy(-1)


def test_a_restore_under_a_file_size_limit_reads_into_memory(tmp_path: Path) -> None:
    """Where no local file can hold the copy (RLIMIT_FSIZE below the checkpoint's size), the
    restore still reads once, into anonymous memory."""
    import resource
    import signal

    box = Box()
    box.tensor = torch.randn(1 << 16)
    with _manager(tmp_path, box) as manager:
        manager.save(10)
    size = (tmp_path / "ckpt-00000010.pt").stat().st_size
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, previous[1]))
    try:
        storage, restored = CountingStorage(), Box()
        with _manager(tmp_path, restored, storage) as manager:
            assert manager.load() and manager.loaded_step == 10
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, handler)
    assert torch.equal(restored.tensor, box.tensor) and storage.data_bytes() == size


def test_crc32c_hashes_a_read_only_mapping_in_place(tmp_path: Path) -> None:
    """A restore hashes a read-only mapping of the checkpoint's bytes: the digest is google-crc32c's,
    split or whole, and hashing 32 MiB allocates no copy of it (tracemalloc's peak stays small)."""
    import mmap
    import tracemalloc

    if not crc32c_available():
        missing_from_env("google-crc32c with its C implementation is not importable", CRC32C_INSTALL)
    import google_crc32c

    from gpu_resilience_worker.fastio import new_hasher

    payload = os.urandom(32 << 20)
    path = tmp_path / "blob"
    path.write_bytes(payload)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        view = memoryview(mapped)
        assert view.readonly
        tracemalloc.start()
        whole = new_hasher("crc32c")
        whole.update(view)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        split = new_hasher("crc32c")
        split.update(view[:12345])
        split.update(view[12345:])
        view.release()
    assert whole.hexdigest() == split.hexdigest() == f"{google_crc32c.value(payload):08x}"
    assert peak < 1 << 20, f"hashing allocated {peak} bytes"
