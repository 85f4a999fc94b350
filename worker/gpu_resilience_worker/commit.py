"""The commit protocol, for both shapes of a task folder's checkpoints: a torn checkpoint is never used.

:class:`CommitStore` writes, finds, verifies and deletes the checkpoints of one task folder, named
by a :class:`~gpu_resilience_worker.task_folder.Naming`: the one-file shape, whose data it streams
itself (:meth:`~CommitStore.write`), or a framework's files and folders, which it commits once the
framework wrote them (:meth:`~CommitStore.commit_written`). Either way the stale record goes first
and the record of :mod:`gpu_resilience_worker.task_folder` last. Why each step, and what discovery,
restore and clean-up do with what they find: the commit protocol in ``docs/worker-contract.rst``.
Only a writer deletes; a record a newer release wrote raises
:class:`~gpu_resilience_worker.errors.NewerCheckpointError` (exit 78).
"""

from __future__ import annotations

import os
import shutil
from typing import Any, BinaryIO, Callable

from gpu_resilience_worker.errors import NewerCheckpointError
from gpu_resilience_worker.fastio import HashingWriter, default_digest, file_chunk_digests, stream_chunk_digests
from gpu_resilience_worker.logs import StructuredLogger, utc_now
from gpu_resilience_worker.policies import KeepLatestN
from gpu_resilience_worker.restore_copy import LocalCopy
from gpu_resilience_worker.snapshot import save_without_crc32
from gpu_resilience_worker.storage import Storage
from gpu_resilience_worker.task_folder import (  # noqa: F401 - re-exported: the layout's names
    COMMIT, DATA, DIGEST_CHUNK, MAX_RECORD_BYTES, CheckpointName, CommitRecord, FileEntry, Naming, parse_record,
)


def read_record(storage: Storage, path: str) -> CommitRecord:
    """Read and parse the commit record at ``path`` (at most :data:`MAX_RECORD_BYTES` of it).

    :param storage: where it is.
    :param path: the record's path.
    :return: the record (either shape, see :mod:`gpu_resilience_worker.task_folder`).
    :raises FileNotFoundError: when it is missing. :raises OSError: when it is unreadable.
    :raises ValueError: when it is torn, malformed or larger than :data:`MAX_RECORD_BYTES`.
    :raises NewerCheckpointError: when a newer release wrote it (exit 78: nothing may be deleted).
    """
    parts, left = [], MAX_RECORD_BYTES + 1
    with storage.open_read(path) as handle:
        while left > 0:
            part = handle.read(min(left, 1 << 20))
            if not part:
                break
            parts.append(part)
            left -= len(part)
    if left <= 0:
        raise ValueError(f"commit record is larger than {MAX_RECORD_BYTES} bytes")
    try:
        return parse_record(b"".join(parts))
    except NewerCheckpointError as exc:
        raise NewerCheckpointError(exc.detail, exc.format, exc.digest, path) from None


class StateWriter:
    """Streams a state to a checkpoint's data file with ``torch.save`` (no zip CRC-32, see
    :func:`~gpu_resilience_worker.snapshot.save_without_crc32`), building its hash list as it goes.

    :param state: the state to save.
    :param digest: the chunk digest (see :func:`~gpu_resilience_worker.fastio.default_digest`).
    """

    def __init__(self, state: dict[str, Any], digest: str) -> None:
        self.state, self.digest = state, digest
        self.size, self.chunks = 0, []

    def __call__(self, handle: BinaryIO) -> None:
        """Write the state into ``handle`` (what :meth:`Storage.write` calls)."""
        writer = HashingWriter(handle, digest=self.digest)
        try:
            save_without_crc32(self.state, writer)
        except RuntimeError as exc:
            # torch's zip writer ends its archive even when a write of it raised, and that fails
            # too ("unexpected pos"): the write's own error (ENOSPC...) is what happened
            if isinstance(exc.__context__, OSError):
                raise exc.__context__ from None
            raise
        self.chunks, self.size = writer.digests(), writer.size


class CommitStore:
    """Writes, discovers, verifies and deletes the committed checkpoints of one task folder.

    :param folder: the task folder (a plain path string).
    :param storage: the storage backend.
    :param logger: structured logger.
    :param naming: how the checkpoints are named; default the one-file shape
        (:data:`~gpu_resilience_worker.task_folder.CheckpointName`).
    """

    def __init__(self, folder: str, storage: Storage, logger: StructuredLogger,
                 naming: Naming = CheckpointName) -> None:
        self.folder = folder.rstrip("/") or "/"
        self.storage, self.naming = storage, naming
        self._log = logger
        self._verified: dict[int, str] = {}  # step -> sha256 verified (or written) by this process
        #: step -> sha256 of a commit record whose data this process found corrupt or unloadable:
        #: such a checkpoint is not counted as kept (its size alone would pass), so retention
        #: does not delete a valid checkpoint in its place
        self._invalid: dict[int, str] = {}
        #: the chunk digest of the one-file checkpoints this store writes (see :func:`default_digest`)
        self.digest = default_digest()
        #: steps retention leaves alone: newer than the one resumed from and there at the restore
        #: (:meth:`resumed_from`), or a newer release's; until this process rewrites them
        self._protected: set[int] = set()

    def path(self, step: int, kind: str = DATA) -> str:
        """:return: the path of the data (a file, or a framework's folder) or commit record of ``step``."""
        return f"{self.folder}/{self.naming.build(step, kind)}"

    def present_steps(self, kind: str | None = None) -> list[int]:
        """
        :return: every step with data or a commit record (only ``kind`` when given), newest first."""
        steps = set()
        for name in self.storage.list(self.folder):
            parsed = self.naming.parse(name)
            if parsed is not None and not parsed.temporary and kind in (None, parsed.kind):
                steps.add(parsed.step)
        return sorted(steps, reverse=True)

    def record(self, step: int) -> tuple[CommitRecord | None, str]:
        """:return: ``(record, "")``, or ``(None, reason)`` when it is missing or invalid.

        :raises NewerCheckpointError: when a newer release wrote it (not an invalid record).
        """
        try:
            record = read_record(self.storage, self.path(step, COMMIT))
        except FileNotFoundError:
            return None, "no commit record (uncommitted)"
        except (OSError, ValueError) as exc:
            return None, f"unreadable commit record: {exc}"
        if record.step != step or record.name != self.naming.record_name(step):
            return None, f"commit record is for step {record.step} ({record.name or 'one file'}), not this checkpoint"
        return record, ""

    def newer_record(self) -> NewerCheckpointError | None:
        """
        :return: the refusal of the newest commit record here that a newer release wrote, or
            ``None`` (reads the records only, never the data)."""
        for step in self.present_steps(COMMIT):
            try:
                self.record(step)
            except NewerCheckpointError as exc:
                return exc
        return None

    def refuse_newer_records(self) -> None:
        """
        :raises NewerCheckpointError: when a newer release wrote a commit record here: nothing
            may be resumed in its place, and nothing deleted (a writer asks before its first
            restore and before its first clean-up)."""
        newer = self.newer_record()
        if newer is not None:
            raise newer

    def is_valid(self, step: int) -> bool:
        """
        :return: whether ``step`` is committed and verified; data already verified (or
            written) by this process is not read again when its commit record is unchanged."""
        record, _ = self.record(step)
        if record is not None and self._verified.get(step) == record.sha256:
            return True
        return self.verify(step)[0]

    def verify(self, step: int) -> tuple[bool, str]:
        """Check one checkpoint against its commit record, reading (and hashing) every file it lists.

        :return: ``(True, "")`` when valid, else ``(False, reason)``.
        """
        reason = self._read(step)[1]
        return not reason, reason

    def read_verified(self, step: int, stop: Callable[[], bool] | None = None,
                      place: Callable[[Any], dict[str, tuple[int, Any]]] | None = None) -> tuple[LocalCopy | None, str]:
        """Read a one-file checkpoint's data once, sequentially through :meth:`Storage.open_read`,
        into a private local copy, checking it against its commit record as it is read.

        The copy is what gets loaded, so the bytes loaded are the bytes verified (a file that
        changes afterwards cannot slip in), and the data is read from storage exactly once.
        Peak memory: one checkpoint's size (the copy), which a ``mmap=True`` load shares.

        :param step: the checkpoint's step.
        :param stop: asked between reads; when it returns true, reading ends and ``(None,
            reason)`` is returned (the checkpoint is not marked invalid); default never.
        :param place: the copy's ``place`` (:class:`LocalCopy`); default none placed.
        :return: ``(copy, "")`` when valid (the caller closes the copy), else ``(None, reason)``.
        """
        return self._read(step, keep=True, stop=stop, place=place)

    def _read(self, step: int, keep: bool = False, stop: Callable[[], bool] | None = None,
              place: Callable[[Any], dict[str, tuple[int, Any]]] | None = None) -> tuple[LocalCopy | None, str]:
        """Verify ``step``: each file's size, then its hash list (into a :class:`LocalCopy` when
        ``keep``, one file only). :return: ``(copy or None, "")``, or ``(None, reason)``."""
        record, reason = self.record(step)
        if record is None:
            return None, reason
        copy = None
        for entry in record.files:
            path = f"{self.folder}/{entry.path}"
            try:
                size, digests = self.storage.size(path), []
                if size == entry.size:  # a wrong size needs no hashing
                    copy = LocalCopy(size, place) if keep and len(record.files) == 1 else None
                    size, digests = self._digests(path, entry, copy, stop)
                reason = self._mismatch(step, record, entry, size, digests)
            except (OSError, ValueError, ImportError) as exc:
                reason = f"unreadable data file: {exc}"
            except BaseException:  # an interrupt: the copy still puts back what it placed
                if copy is not None:
                    copy.close()
                raise
            if reason:
                if copy is not None:
                    copy.close()
                return None, (reason if record.name is None else f"{entry.path}: {reason}")
        self._verified[step] = record.sha256
        self._invalid.pop(step, None)
        return copy, ""

    def _digests(self, path: str, entry: FileEntry, copy: LocalCopy | None,
                 stop: Callable[[], bool] | None) -> tuple[int, list[str]]:
        """:return: the size and hash list of ``path`` as read into ``copy``, mapped, or streamed."""
        local = None if copy is not None else self.storage.local_path(path)
        if local is not None:
            return file_chunk_digests(local, entry.chunk_bytes, entry.digest)
        with self.storage.open_read(path) as handle:
            if copy is not None:
                return copy.fill(handle, entry.chunk_bytes, entry.digest, stop)
            return stream_chunk_digests(handle, entry.chunk_bytes, entry.digest)

    def _mismatch(self, step: int, record: CommitRecord, entry: FileEntry, size: int, digests: list[str]) -> str:
        """:return: how ``size`` and ``digests`` differ from ``entry`` (``""``: they match); a
        digest that differs marks ``step`` invalid."""
        if size != entry.size:
            return f"size {size} bytes, commit record says {entry.size}"
        bad = next((i for i, (a, b) in enumerate(zip(digests, entry.chunks)) if a != b), None)
        if bad is None:
            return ""
        self._invalid[step] = record.sha256
        start = bad * entry.chunk_bytes
        return f"{entry.digest} of bytes {start}-{min(start + entry.chunk_bytes, size) - 1} does not match the commit record"

    def mark_invalid(self, step: int) -> None:
        """Remember that the data of ``step``'s current commit record is unusable (found corrupt,
        or not loadable), so that :meth:`committed_steps` no longer counts it. A new commit
        record for the step (a rewrite) clears it."""
        record, _ = self.record(step)
        if record is not None:
            self._invalid[step] = record.sha256
            self._verified.pop(step, None)

    def committed_steps(self) -> list[int]:
        """
        :return: newest first, the steps whose commit record is valid and whose files have the
            recorded sizes, data unread (what retention counts as kept: re-reading every kept
            checkpoint after each save would download it again on Cloud Storage FUSE). Checkpoints
            this process wrote or verified count without a look at the data; those it found corrupt
            or unloadable (:meth:`mark_invalid`) do not count."""
        steps = []
        for step in self.present_steps(COMMIT):
            try:
                record, _ = self.record(step)
            except NewerCheckpointError:  # appeared since the restore: not ours to count or delete
                self._protected.add(step)
                continue
            if record is None or self._invalid.get(step) == record.sha256:
                continue
            if self._verified.get(step) != record.sha256:
                try:
                    if any(self.storage.size(f"{self.folder}/{f.path}") != f.size for f in record.files):
                        continue
                except OSError:
                    continue
            steps.append(step)
        return steps

    def valid_steps(self) -> list[int]:
        """:return: the steps of committed, verified checkpoints, newest first."""
        return [s for s in self.present_steps() if self.is_valid(s)]

    def resumed_from(self, step: int) -> None:
        """Record that this writer restored ``step`` (0: none). The checkpoints newer than it that
        are here now were skipped by the restore; :meth:`apply_retention` deletes one of them only
        when this process read it and found it corrupt or unloadable (:meth:`mark_invalid`), never
        one it could not judge (a record unreadable at the time, a newer release's record). A save
        of the same step replaces its files as any save does."""
        self._protected |= {s for s in self.present_steps() if s > step}

    def apply_retention(self, keep: KeepLatestN) -> list[int]:
        """After a commit, delete (record first, then data) the checkpoints ``keep`` no longer
        keeps, except the ones :meth:`resumed_from` protects.

        :param keep: the retention policy.
        :return: the steps deleted, oldest first.
        """
        doomed = [s for s in keep.to_delete(self.present_steps(), self.committed_steps())
                  if s not in self._protected or s in self._invalid]
        for step in doomed:
            self._log.info("deleting old checkpoint", step=step, checkpoint=self.naming.build(step))
            self.delete(step)
        return doomed

    def begin(self, step: int) -> None:
        """Before ``step`` is written: remove its stale record, then its data (every save writes
        new objects, never truncating an old one), and forget this process's verdicts on it."""
        self.storage.remove(self.path(step, COMMIT))
        local = self.storage.local_path(self.path(step))
        if not self.naming.one_file and local is not None and os.path.isdir(local) and not os.path.islink(local):
            shutil.rmtree(local)
        else:
            self.storage.remove(self.path(step))
        self._forget(step)

    def write(self, step: int, state: dict[str, Any]) -> CommitRecord:
        """Commit ``state`` as the one-file checkpoint of ``step``: :meth:`begin`, data, record.

        :return: the commit record written.
        :raises OSError: when a write fails (the checkpoint is then not committed).
        """
        self.begin(step)
        writer = StateWriter(state, self.digest)
        try:
            self.storage.write(self.path(step), writer)  # raises when close() fails: then no record
        except BaseException:
            # what was written of it is no checkpoint: give its space back now (a full disk
            # stays full otherwise, until the next attempt's first save cleans up)
            try:
                self._remove(self.naming.build(step), step, "a failed save's data file")
            except OSError:
                pass
            raise
        self._log.debug("checkpoint data written", step=step, file=self.path(step))
        return self._write_record(CommitRecord.of_chunks(step, writer.size, writer.chunks, utc_now(), digest=writer.digest))

    def commit_written(self, step: int) -> CommitRecord:
        """Commit what a framework wrote as the checkpoint of ``step`` (after :meth:`begin`): hash
        its file, or every file in its folder (symlinks left out), then write the record.

        :return: the commit record written.
        :raises FileNotFoundError: when it is missing or holds no file.
        :raises OSError: when hashing or writing the record fails (then it is not committed).
        """
        name, root = self.naming.build(step), self.path(step)
        paths = [root] if os.path.isfile(root) and not os.path.islink(root) else sorted(
            os.path.join(base, file) for base, _, files in os.walk(root) for file in files)
        files = []
        for path in paths:
            if not os.path.islink(path):
                size, chunks = file_chunk_digests(path, DIGEST_CHUNK)
                files.append(FileEntry(os.path.relpath(path, self.folder), size, DIGEST_CHUNK, tuple(chunks)))
        if not files:
            raise FileNotFoundError(f"no checkpoint written at {root}")
        return self._write_record(CommitRecord.of_files(step, name, files, utc_now()))

    def _write_record(self, record: CommitRecord) -> CommitRecord:
        """Write ``record`` last, through a temporary name."""
        self.storage.write(self.path(record.step, COMMIT), record.to_bytes(), atomic=True)
        self._verified[record.step] = record.sha256
        return record

    def _remove(self, name: str, step: int, what: str) -> bool:
        local = self.storage.local_path(f"{self.folder}/{name}")
        if not self.naming.one_file and local is not None and os.path.isdir(local) \
                and os.path.realpath(self.folder) == os.path.abspath(self.folder) and not os.path.islink(local):
            shutil.rmtree(local)
            return True
        if self.storage.remove_entry(self.folder, name):
            return True
        self._log.warning(f"not deleting {what}: a symlink, or in a symlinked folder", file=name, step=step)
        return False

    def delete(self, step: int) -> None:
        """Delete the commit record, then the data, of ``step`` (never through a symlink)."""
        for kind in (COMMIT, DATA):
            try:
                self._remove(self.naming.build(step, kind), step, "an old checkpoint file")
            except OSError as exc:
                self._log.warning("could not delete old checkpoint", step=step, error=str(exc))
        self._forget(step)

    def _forget(self, step: int) -> None:
        """Drop this process's verdicts on ``step`` (its files are gone or being rewritten)."""
        self._verified.pop(step, None)
        self._invalid.pop(step, None)
        self._protected.discard(step)

    def cleanup_stale(self) -> list[int]:
        """Remove leftovers of a killed attempt: temporary files, and data without a commit record.
        Only a writer calls this (before its first save), never a reader.

        :return: the steps of what was removed, in name order.
        :raises NewerCheckpointError: when a newer release wrote a record here (nothing deleted).
        """
        self.refuse_newer_records()
        names = set(self.storage.list(self.folder))
        removed = []
        for name in sorted(names):
            parsed = self.naming.parse(name)
            if parsed is None:
                continue
            stale = parsed.kind == DATA and self.naming.build(parsed.step, COMMIT) not in names
            if (parsed.temporary or stale) and self._remove(name, parsed.step, "a stale checkpoint file"):
                self._log.info("removed stale checkpoint file", file=name, step=parsed.step)
                removed.append(parsed.step)
        return removed
