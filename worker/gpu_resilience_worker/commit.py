"""The commit protocol: a checkpoint that is torn is never used.

No atomic rename is assumed (GCS FUSE renames by copy and delete). To commit step ``s``:

1. Remove any stale commit record of ``s`` (left by an earlier attempt), then any data file of it:
   every save creates new objects, never truncates or overwrites one (on Cloud Storage FUSE that
   would stage the whole file in memory).
2. Stream the data to ``ckpt-{s:08d}.pt`` sequentially (nothing reads it back), flush, fsync and
   close it. The commit record follows only a successful ``close()``: on Cloud Storage FUSE the
   object is created, and an upload error reported, at close.
3. Write the commit record ``ckpt-{s:08d}.commit.json`` = ``{step, size, digest, sha256,
   chunk_bytes, chunks, created_at}`` last, through a temporary name, fsync and rename. ``chunks``
   is the data's hash list (the ``digest`` of every ``chunk_bytes`` bytes: ``crc32c`` or ``crc32``
   for new checkpoints; records without ``digest``, written by earlier versions, mean ``sha256``)
   and ``sha256`` the sha256 of the concatenated binary chunk digests
   (:mod:`gpu_resilience_worker.fastio`).

A checkpoint exists only when its commit record parses and matches the data's size and every
chunk's digest. A restore reads the data once: into one private local copy
(:class:`~gpu_resilience_worker.fastio.LocalCopy`), verified while it is read, and loads that
copy (:meth:`CommitStore.read_verified`). Anything else (a data file with no record, a truncated or corrupted file, a torn
or oversized record) is ignored by discovery and skipped, with a warning, on load. Stale files
(temporary names, data without a record) are removed by :meth:`CommitStore.cleanup_stale`, which
only a writer calls; reading a folder never deletes anything.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable

from gpu_resilience_worker.fastio import (
    DIGEST_CHUNK, DIGESTS, HEX_CHARS, HashingWriter, LocalCopy, default_digest, file_chunk_digests,
    root_digest, save_without_crc32, stream_chunk_digests,
)
from gpu_resilience_worker.logs import StructuredLogger, utc_now
from gpu_resilience_worker.storage import Storage

DATA = "data"
COMMIT = "commit"
_SUFFIX = {DATA: ".pt", COMMIT: ".commit.json"}
#: Smallest ``chunk_bytes`` a commit record may carry, in bytes (one 4 KiB page): bounds the
#: work and memory a record asks of the verifier.
MIN_CHUNK_BYTES = 4096
#: Largest commit record read, in bytes (8 MiB: the hash list of about 7 TiB of data in 64 MiB
#: chunks). A larger one is invalid, like a torn one, and is never read whole.
MAX_RECORD_BYTES = 8 << 20
_NAME_RE = re.compile(r"^ckpt-(?P<step>\d{8,})(?P<suffix>\.pt|\.commit\.json)(?P<tmp>\.tmp)?$")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX = re.compile(r"[0-9a-f]+")


@dataclasses.dataclass(frozen=True)
class ParsedName:
    """A parsed checkpoint file name.

    :param step: the optimizer step of the checkpoint.
    :param kind: :data:`DATA` or :data:`COMMIT`.
    :param temporary: whether the name carries the ``.tmp`` suffix of an unfinished write.
    """

    step: int
    kind: str
    temporary: bool = False


class CheckpointName:
    """Builds and parses checkpoint file names with one anchored regex."""

    @staticmethod
    def build(step: int, kind: str = DATA) -> str:
        """:return: ``ckpt-{step:08d}.pt`` for data, ``ckpt-{step:08d}.commit.json`` for a record.

        :param step: a non-negative step.
        :param kind: :data:`DATA` or :data:`COMMIT`.
        :raises ValueError: for a negative or non-int step, or another kind.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if kind not in _SUFFIX:
            raise ValueError(f"kind must be {DATA!r} or {COMMIT!r}, got {kind!r}")
        return f"ckpt-{step:08d}{_SUFFIX[kind]}"

    @staticmethod
    def parse(name: str) -> ParsedName | None:
        """:return: the parsed name, or ``None`` when ``name`` is not a checkpoint file name."""
        match = _NAME_RE.match(name)
        if match is None:
            return None
        kind = DATA if match.group("suffix") == ".pt" else COMMIT
        return ParsedName(int(match.group("step")), kind, match.group("tmp") is not None)


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """The record that commits one checkpoint.

    :param step: the step of the checkpoint.
    :param size: size of the data file, in bytes.
    :param sha256: hex sha256 of the concatenated binary ``chunks`` digests.
    :param created_at: RFC 3339 UTC time of the commit.
    :param chunk_bytes: bytes per entry of ``chunks`` (the last chunk may be shorter).
    :param chunks: hex ``digest`` of every ``chunk_bytes`` bytes of the data file, in order.
    :param digest: the chunk digest, one of :data:`~gpu_resilience_worker.fastio.DIGESTS`;
        default ``sha256`` (what a record without the field means).
    """

    step: int
    size: int
    sha256: str
    created_at: str
    chunk_bytes: int
    chunks: tuple[str, ...]
    digest: str = "sha256"

    @classmethod
    def of_chunks(cls, step: int, size: int, chunks: list[str], created_at: str,
                  chunk_bytes: int = DIGEST_CHUNK, digest: str = "sha256") -> CommitRecord:
        """:return: the record of a data file of ``size`` bytes with hash list ``chunks``."""
        return cls(step, size, root_digest(chunks), created_at, chunk_bytes, tuple(chunks), digest)

    def to_bytes(self) -> bytes:
        """:return: the record as JSON bytes (a sha256 record without the ``digest`` field, as
        earlier versions wrote it)."""
        obj = {**dataclasses.asdict(self), "chunks": list(self.chunks)}
        if self.digest == "sha256":
            del obj["digest"]
        return json.dumps(obj, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> CommitRecord:
        """Parse and validate a record.

        :raises ValueError: when it is torn or malformed, or its hash list does not cover
            ``size`` or does not hash to ``sha256``.
        """
        try:
            obj = json.loads(raw.decode())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"commit record is not valid JSON: {exc!r}"[:200]) from None
        if not isinstance(obj, dict):
            raise ValueError("commit record is not a JSON object")
        step, size, digest = obj.get("step"), obj.get("size"), obj.get("sha256")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, size)):
            raise ValueError("commit record has no valid step or size")
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ValueError("commit record has no valid sha256")
        chunk_bytes, chunks, kind = obj.get("chunk_bytes"), obj.get("chunks"), obj.get("digest", "sha256")
        if kind not in DIGESTS:
            raise ValueError(f"commit record's digest must be one of {DIGESTS}")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError(f"commit record has no valid chunk_bytes (an int >= {MIN_CHUNK_BYTES})")
        if not isinstance(chunks, list) or len(chunks) != -(-size // chunk_bytes):
            raise ValueError(f"commit record's hash list does not cover {size} bytes")
        width = HEX_CHARS[kind]
        if not all(isinstance(c, str) and len(c) == width and _HEX.fullmatch(c) for c in chunks):
            raise ValueError("commit record's hash list has an invalid digest")
        if root_digest(chunks) != digest:
            raise ValueError("commit record's sha256 does not match its hash list")
        return cls(step, size, digest, str(obj.get("created_at", "")), chunk_bytes, tuple(chunks), kind)


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

    def path(self, step: int, kind: str = DATA) -> str:
        """:return: the path of the data file or commit record of ``step``."""
        return f"{self.folder}/{CheckpointName.build(step, kind)}"

    def present_steps(self, kind: str | None = None) -> list[int]:
        """:return: every step with a data file or commit record (only ``kind`` when given),
        newest first."""
        steps = set()
        for name in self.storage.list(self.folder):
            parsed = CheckpointName.parse(name)
            if parsed is not None and not parsed.temporary and kind in (None, parsed.kind):
                steps.add(parsed.step)
        return sorted(steps, reverse=True)

    def _read_record_bytes(self, step: int) -> bytes:
        parts, left = [], MAX_RECORD_BYTES + 1
        with self.storage.open_read(self.path(step, COMMIT)) as handle:
            while left > 0:
                part = handle.read(min(left, 1 << 20))
                if not part:
                    break
                parts.append(part)
                left -= len(part)
        if left <= 0:
            raise ValueError(f"commit record is larger than {MAX_RECORD_BYTES} bytes")
        return b"".join(parts)

    def record(self, step: int) -> tuple[CommitRecord | None, str]:
        """:return: ``(record, "")``, or ``(None, reason)`` when it is missing or invalid."""
        try:
            record = CommitRecord.from_bytes(self._read_record_bytes(step))
        except FileNotFoundError:
            return None, "no commit record (uncommitted)"
        except (OSError, ValueError) as exc:
            return None, f"unreadable commit record: {exc}"
        if record.step != step:
            return None, f"commit record is for step {record.step}"
        return record, ""

    def is_valid(self, step: int) -> bool:
        """:return: whether ``step`` is committed and verified; data already verified (or
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
        """:return: newest first, the steps whose commit record is valid and whose data file has
        the recorded size, data unread (what retention counts as kept: re-reading every kept
        checkpoint after each save would download it again on Cloud Storage FUSE). Checkpoints
        this process wrote or verified count without a look at the data; those it found corrupt
        or unloadable (:meth:`mark_invalid`) do not count."""
        steps = []
        for step in self.present_steps(COMMIT):
            record, _ = self.record(step)
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

    def cleanup_stale(self) -> None:
        """Remove leftovers of a killed attempt: temporary files and uncommitted data files.
        Only a writer calls this (before its first save), never a reader."""
        names = set(self.storage.list(self.folder))
        for name in sorted(names):
            parsed = CheckpointName.parse(name)
            if parsed is None:
                continue
            if parsed.temporary or (parsed.kind == DATA and CheckpointName.build(parsed.step, COMMIT) not in names):
                if self._remove(name, parsed.step, "a stale checkpoint file"):
                    self._log.info("removed stale checkpoint file", file=name, step=parsed.step)
