"""The commit protocol for one-file checkpoints: a checkpoint that is torn is never used.

To commit step ``s`` (no atomic rename assumed): remove a stale record of ``s``, then its data;
stream the data to ``ckpt-{s:08d}.pt``, fsync and close it; write the record
``ckpt-{s:08d}.commit.json`` last (the one-file shape of :mod:`gpu_resilience_worker.task_folder`).
Why each step, and what discovery, restore and clean-up do with what they find: the commit
protocol in ``docs/worker-contract.rst``. Only a writer deletes (:meth:`CommitStore.cleanup_stale`);
a record a newer release wrote raises
:class:`~gpu_resilience_worker.errors.NewerCheckpointError` (exit 78).
"""

from __future__ import annotations

from typing import Any, Callable

from gpu_resilience_worker.errors import NewerCheckpointError
from gpu_resilience_worker.fastio import HashingWriter, default_digest, file_chunk_digests, stream_chunk_digests
from gpu_resilience_worker.logs import StructuredLogger, utc_now
from gpu_resilience_worker.policies import KeepLatestN
from gpu_resilience_worker.restore_copy import LocalCopy
from gpu_resilience_worker.snapshot import save_without_crc32
from gpu_resilience_worker.storage import Storage
from gpu_resilience_worker.task_folder import (  # noqa: F401 - re-exported: the layout's names
    COMMIT, DATA, MAX_RECORD_BYTES, MIN_CHUNK_BYTES, CheckpointName, CommitRecord, NewerRecordError, ParsedName,
    parse_record,
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
    except NewerRecordError as exc:
        raise NewerCheckpointError(path, exc.format, exc.digest, exc.describe()) from None


def first_newer_record(steps: list[int], read: Callable[[int], Any]) -> NewerCheckpointError | None:
    """The refusal ``read`` raises for the first of ``steps`` whose commit record a newer release
    wrote (reads the records only, never the data).

    :param steps: the steps to look at, newest first.
    :param read: reads and parses one step's record, raising :class:`NewerCheckpointError`.
    :return: that refusal, or ``None``.
    """
    for step in steps:
        try:
            read(step)
        except NewerCheckpointError as exc:
            return exc
    return None


class CommitStore:
    """Writes, discovers, verifies and deletes the committed checkpoints of one folder.

    :param folder: the task's checkpoint namespace (a plain path string).
    :param storage: the storage backend.
    :param logger: structured logger.
    """

    def __init__(self, folder: str, storage: Storage, logger: StructuredLogger) -> None:
        self.folder = folder.rstrip("/") or "/"
        self.storage = storage
        self._log = logger
        self._verified: dict[int, str] = {}  # step -> sha256 verified (or written) by this process
        #: step -> sha256 of a commit record whose data this process found corrupt or unloadable:
        #: such a checkpoint is not counted as kept (its size alone would pass), so retention
        #: does not delete a valid checkpoint in its place
        self._invalid: dict[int, str] = {}
        #: the chunk digest of the checkpoints this store writes (see :func:`default_digest`)
        self.digest = default_digest()
        #: steps retention leaves alone: newer than the one resumed from and there at the restore
        #: (:meth:`resumed_from`), or a newer release's; until this process rewrites them
        self._protected: set[int] = set()

    def path(self, step: int, kind: str = DATA) -> str:
        """:return: the path of the data file or commit record of ``step``."""
        return f"{self.folder}/{CheckpointName.build(step, kind)}"

    def present_steps(self, kind: str | None = None) -> list[int]:
        """
        :return: every step with a data file or commit record (only ``kind`` when given),
            newest first."""
        steps = set()
        for name in self.storage.list(self.folder):
            parsed = CheckpointName.parse(name)
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
        if record.name is not None:
            return None, f"commit record is a folder's ({record.name}), not a one-file checkpoint's"
        if record.step != step:
            return None, f"commit record is for step {record.step}"
        return record, ""

    def newer_record(self) -> NewerCheckpointError | None:
        """:return: the refusal of the newest commit record here that a newer release wrote, or ``None``."""
        return first_newer_record(self.present_steps(COMMIT), self.record)

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
        """Check one checkpoint against its commit record, reading (and hashing) all its data.

        :return: ``(True, "")`` when valid, else ``(False, reason)``.
        """
        record, reason = self.record(step)
        if record is None:
            return False, reason
        path = self.path(step, DATA)
        try:
            size = self.storage.size(path)  # a wrong size needs no hashing
            if size != record.size:
                return False, f"size {size} bytes, commit record says {record.size}"
            local = self.storage.local_path(path)
            if local is not None:
                size, digests = file_chunk_digests(local, record.chunk_bytes, record.digest)
            else:
                with self.storage.open_read(path) as handle:
                    size, digests = stream_chunk_digests(handle, record.chunk_bytes, record.digest)
        except (OSError, ValueError, ImportError) as exc:
            return False, f"unreadable data file: {exc}"
        return self._check(step, record, size, digests)

    def _check(self, step: int, record: CommitRecord, size: int, digests: list[str]) -> tuple[bool, str]:
        if size != record.size:
            return False, f"size {size} bytes, commit record says {record.size}"
        bad = next((i for i, (a, b) in enumerate(zip(digests, record.chunks)) if a != b), None)
        if bad is not None:
            self._invalid[step] = record.sha256
            start = bad * record.chunk_bytes
            return False, (f"{record.digest} of bytes {start}-{min(start + record.chunk_bytes, size) - 1}"
                           " does not match the commit record")
        self._verified[step] = record.sha256
        self._invalid.pop(step, None)
        return True, ""

    def read_verified(self, step: int, stop: Callable[[], bool] | None = None) -> tuple[LocalCopy | None, str]:
        """Read one checkpoint's data once, sequentially through :meth:`Storage.open_read`, into
        a private local copy, checking it against its commit record as it is read.

        The copy is what gets loaded, so the bytes loaded are the bytes verified (a file that
        changes afterwards cannot slip in), and the data is read from storage exactly once.
        Peak memory: one checkpoint's size (the copy), which a ``mmap=True`` load shares.

        :param step: the checkpoint's step.
        :param stop: asked between reads; when it returns true, reading ends and ``(None,
            reason)`` is returned (the checkpoint is not marked invalid); default never.
        :return: ``(copy, "")`` when valid (the caller closes the copy), else ``(None, reason)``.
        """
        record, reason = self.record(step)
        if record is None:
            return None, reason
        path = self.path(step, DATA)
        copy: LocalCopy | None = None
        try:
            size = self.storage.size(path)
            if size != record.size:
                return None, f"size {size} bytes, commit record says {record.size}"
            copy = LocalCopy(size)
            with self.storage.open_read(path) as handle:
                size, digests = copy.fill(handle, record.chunk_bytes, record.digest, stop)
            ok, reason = self._check(step, record, size, digests)
        except (OSError, ValueError, ImportError) as exc:
            ok, reason = False, f"unreadable data file: {exc}"
        if not ok and copy is not None:
            copy.close()
            copy = None
        return copy, reason

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
        :return: newest first, the steps whose commit record is valid and whose data file has
            the recorded size, data unread (what retention counts as kept: re-reading every kept
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
                    if self.storage.size(self.path(step, DATA)) != record.size:
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
            self.delete(step)
        return doomed

    def write(self, step: int, state: dict[str, Any]) -> CommitRecord:
        """Commit ``state`` as the checkpoint of ``step``: stale record out, data, record.

        :return: the commit record written.
        :raises OSError: when a write fails (the checkpoint is then not committed).
        """
        data_path, commit_path = self.path(step, DATA), self.path(step, COMMIT)
        self.storage.remove(commit_path)
        self.storage.remove(data_path)  # a new object: never truncate an old one
        self._forget(step)
        result: dict[str, Any] = {}
        digest = self.digest

        def produce(handle: Any) -> None:
            writer = HashingWriter(handle, digest=digest)
            try:
                save_without_crc32(state, writer)
            except RuntimeError as exc:
                # torch's zip writer ends its archive even when a write of it raised, and that
                # fails too ("unexpected pos"): the write's own error (ENOSPC...) is what happened
                if isinstance(exc.__context__, OSError):
                    raise exc.__context__ from None
                raise
            result["chunks"], result["size"] = writer.digests(), writer.size

        try:
            self.storage.write(data_path, produce)  # raises when close() fails: then no record
        except BaseException:
            # what was written of it is no checkpoint: give its space back now (a full disk
            # stays full otherwise, until the next attempt's first save cleans up)
            try:
                self._remove(CheckpointName.build(step, DATA), step, "a failed save's data file")
            except OSError:
                pass
            raise
        self._log.debug("checkpoint data written", step=step, file=data_path)
        record = CommitRecord.of_chunks(step, result["size"], result["chunks"], utc_now(), digest=digest)
        self.storage.write(commit_path, record.to_bytes(), atomic=True)
        self._verified[step] = record.sha256
        return record

    def _remove(self, name: str, step: int, what: str) -> bool:
        if self.storage.remove_entry(self.folder, name):
            return True
        self._log.warning(f"not deleting {what}: a symlink, or in a symlinked folder",
                          file=name, step=step)
        return False

    def delete(self, step: int) -> None:
        """Delete the commit record, then the data, of ``step`` (never through a symlink)."""
        for kind in (COMMIT, DATA):
            try:
                self._remove(CheckpointName.build(step, kind), step, "an old checkpoint file")
            except OSError as exc:
                self._log.warning("could not delete old checkpoint", step=step, error=str(exc))
        self._forget(step)

    def _forget(self, step: int) -> None:
        """Drop this process's verdicts on ``step`` (its files are gone or being rewritten)."""
        self._verified.pop(step, None)
        self._invalid.pop(step, None)
        self._protected.discard(step)

    def cleanup_stale(self) -> None:
        """Remove leftovers of a killed attempt: temporary files and uncommitted data files.
        Only a writer calls this (before its first save), never a reader.

        :raises NewerCheckpointError: when a newer release wrote a record here (nothing deleted).
        """
        self.refuse_newer_records()
        names = set(self.storage.list(self.folder))
        for name in sorted(names):
            parsed = CheckpointName.parse(name)
            if parsed is None:
                continue
            if parsed.temporary or (parsed.kind == DATA and CheckpointName.build(parsed.step, COMMIT) not in names):
                if self._remove(name, parsed.step, "a stale checkpoint file"):
                    self._log.info("removed stale checkpoint file", file=name, step=parsed.step)
