"""The task folder's contract as pure code (no I/O, no torch): its file names and the one commit-record schema.

``docs/worker-contract.rst`` holds the names, both record shapes (one file, folder), the digests and why format 1
is what the previous release wrote; this module is its one implementation (the provider reads the schema from
that document and imports nothing from the worker). A checkpoint is committed when its record parses and every
file it lists has the recorded size and chunk digests. A newer release's record (a ``format`` above
:data:`FORMAT`, or a ``digest`` not in :data:`DIGESTS`) is not a torn record: :func:`parse_record` raises
:class:`~gpu_resilience_worker.errors.NewerCheckpointError`, and a reader must then neither use an older
checkpoint in its place nor delete anything (the worker exits 78)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any, Iterable

from gpu_resilience_worker.errors import NewerCheckpointError

#: The commit-record format this release writes and the newest it reads.
FORMAT = 1
RECORD_SUFFIX = ".commit.json"
DATA_SUFFIX = ".pt"
#: The suffix of a file being written (an unfinished write; never read as a checkpoint).
TMP_SUFFIX = ".tmp"
#: The worker's progress, rewritten at most once a second.
PROGRESS = "progress.json"
#: The run's final metrics.
METRICS = "metrics.json"
#: Every attempt of the run, where it resumed and the work it lost.
ATTEMPTS = "attempts.json"
#: The marker of a non-retryable error.
FATAL = "FATAL"
#: The probe file the worker writes and removes to check that the folder is writable.
WRITE_PROBE = ".write-probe"
#: File name prefix of the goodput events files.
GOODPUT_PREFIX = "goodput-"
#: Chunk digests a record may name: ``sha256`` (what a record without ``digest`` means),
#: ``crc32c`` (Castagnoli, what Cloud Storage checks) and ``crc32`` (zlib's), each big-endian hex.
DIGESTS = ("sha256", "crc32c", "crc32")
#: Hex characters of one chunk digest, per algorithm.
HEX_CHARS = {"sha256": 64, "crc32c": 8, "crc32": 8}
#: Bytes per digest of a hash list the worker writes (64 MiB: 16 digests for a 1 GiB file).
DIGEST_CHUNK = 64 << 20
#: Smallest ``chunk_bytes`` a record may carry (one 4 KiB page): bounds the work a record asks of a verifier.
MIN_CHUNK_BYTES = 4096
#: Largest record read, in bytes (8 MiB: the hash list of about 7 TiB in 64 MiB chunks); a larger one is
#: invalid, like a torn one, and is never read whole.
MAX_RECORD_BYTES = 8 << 20
#: What a name is: a checkpoint's data (a file, or a framework's folder) or its commit record.
DATA, COMMIT = "data", "commit"
_SAFE_AFFIX = re.compile(r"[A-Za-z0-9._=-]*")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX = re.compile(r"[0-9a-f]+")


def goodput_file_name(execution: str, attempt: int) -> str:
    """:return: ``goodput-{execution}-{attempt}.json`` (``local`` when the execution is unknown)."""
    return f"{GOODPUT_PREFIX}{execution or 'local'}-{attempt}.json"


@dataclasses.dataclass(frozen=True)
class ParsedName:
    """A parsed checkpoint name.

    :param step: the optimizer step of the checkpoint.
    :param kind: :data:`DATA` or :data:`COMMIT`.
    :param temporary: whether the name carries the ``.tmp`` suffix of an unfinished write."""

    step: int
    kind: str
    temporary: bool = False


class Naming:
    """How one task folder names its checkpoints and their records, built and parsed by one anchored
    regex: the one-file shape (:data:`CheckpointName`) or a framework's (:meth:`folder_shape`).

    :param prefix: the name before the step.
    :param data_suffix: the data's name after the step.
    :param record_suffix: the record's name after the step.
    :param width: digits of the step at least (zero-padded); 0: as they come.
    :param one_file: records of the one-file shape (no ``name``, no ``files``)."""

    def __init__(self, prefix: str, data_suffix: str, record_suffix: str, width: int = 0,
                 one_file: bool = False) -> None:
        self.prefix, self.width, self.one_file = prefix, width, one_file
        self._suffix = {DATA: data_suffix, COMMIT: record_suffix}
        self._re = re.compile(rf"^{re.escape(prefix)}(?P<step>\d{{{max(width, 1)},}})"
                              rf"(?P<suffix>{re.escape(record_suffix)}|{re.escape(data_suffix)})(?P<tmp>\.tmp)?$")

    @classmethod
    def folder_shape(cls, prefix: str, suffix: str = "") -> Naming:
        """:return: the naming of a framework's ``{prefix}{step}{suffix}`` and ``{prefix}{step}{suffix}.commit.json``.
        :raises ValueError: a prefix or suffix with other characters than letters, digits and ``._=-``, an empty
            prefix, or a suffix that ends like a record's name."""
        if not isinstance(prefix, str) or not prefix or not _SAFE_AFFIX.fullmatch(prefix):
            raise ValueError(f"prefix must be non-empty letters, digits or ._=-, got {prefix!r}")
        if not isinstance(suffix, str) or not _SAFE_AFFIX.fullmatch(suffix) or suffix.endswith(RECORD_SUFFIX):
            raise ValueError(f"suffix must be letters, digits or ._=- (not a record name), got {suffix!r}")
        return cls(prefix, suffix, suffix + RECORD_SUFFIX)

    def build(self, step: int, kind: str = DATA) -> str:
        """:return: the name of the data (default) or the record of ``step``.
        :raises ValueError: for a negative or non-int step, or another kind."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if kind not in self._suffix:
            raise ValueError(f"kind must be {DATA!r} or {COMMIT!r}, got {kind!r}")
        return f"{self.prefix}{str(step).zfill(self.width)}{self._suffix[kind]}"

    def parse(self, name: str) -> ParsedName | None:
        """:return: the parsed name, or ``None`` when ``name`` is none of this naming's."""
        match = self._re.match(name)
        if match is None:
            return None
        kind = COMMIT if match.group("suffix") == self._suffix[COMMIT] else DATA
        return ParsedName(int(match.group("step")), kind, match.group("tmp") is not None)

    def record_name(self, step: int) -> str | None:
        """:return: the ``name`` a record of ``step`` holds: ``None`` in the one-file shape."""
        return None if self.one_file else self.build(step)


#: The one-file shape: ``ckpt-{step:08d}.pt`` and ``ckpt-{step:08d}.commit.json``.
CheckpointName = Naming("ckpt-", DATA_SUFFIX, RECORD_SUFFIX, width=8, one_file=True)


def root_digest(chunks: Iterable[str]) -> str:
    """:return: the sha256 (hex) of the concatenated binary digests ``chunks`` (hex, in order).
    :raises ValueError: when a digest is not hex."""
    return hashlib.sha256(b"".join(bytes.fromhex(c) for c in chunks)).hexdigest()


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One file a commit record commits.

    :param path: the file, relative to the task folder.
    :param size: its size, in bytes.
    :param chunk_bytes: bytes per entry of ``chunks`` (>= :data:`MIN_CHUNK_BYTES`).
    :param chunks: the hex ``digest`` of every ``chunk_bytes`` bytes, in order.
    :param digest: one of :data:`DIGESTS`; default ``sha256``."""

    path: str
    size: int
    chunk_bytes: int
    chunks: tuple[str, ...]
    digest: str = "sha256"

    @property
    def sha256(self) -> str:
        """:func:`root_digest` of :attr:`chunks`."""
        return root_digest(self.chunks)

    def fields(self) -> dict[str, Any]:
        """:return: the entry's JSON fields (no ``path``; no ``digest`` when it is ``sha256``)."""
        digest = {} if self.digest == "sha256" else {"digest": self.digest}
        return {"size": self.size, "chunk_bytes": self.chunk_bytes, "chunks": list(self.chunks), **digest}


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """A commit record, in either shape (see the module docs).

    :param step: the checkpoint's step.
    :param files: the files it commits (one for the one-file shape).
    :param sha256: the record's root digest.
    :param created_at: RFC 3339 UTC time of the commit (``""`` when the record has none).
    :param name: the checkpoint's name in the folder shape; ``None`` in the one-file shape.
    :param format: the schema's version; default :data:`FORMAT`."""

    step: int
    files: tuple[FileEntry, ...]
    sha256: str
    created_at: str = ""
    name: str | None = None
    format: int = FORMAT

    @classmethod
    def of_chunks(cls, step: int, size: int, chunks: list[str], created_at: str,
                  chunk_bytes: int = DIGEST_CHUNK, digest: str = "sha256") -> CommitRecord:
        """:return: the one-file record of ``ckpt-{step:08d}.pt`` of ``size`` bytes, hash list ``chunks``."""
        entry = FileEntry(CheckpointName.build(step, DATA), size, chunk_bytes, tuple(chunks), digest)
        return cls(step, (entry,), entry.sha256, created_at)

    @classmethod
    def of_files(cls, step: int, name: str, files: Iterable[FileEntry], created_at: str) -> CommitRecord:
        """:return: the folder-shape record of checkpoint ``name`` made of ``files``."""
        files = tuple(files)
        return cls(step, files, root_digest(f.sha256 for f in files), created_at, name)

    @property
    def size(self) -> int:
        """Bytes of all its files."""
        return sum(f.size for f in self.files)

    @property
    def data(self) -> FileEntry:
        """The one file of a one-file record (its first file in the folder shape)."""
        return self.files[0]

    def to_bytes(self) -> bytes:
        """:return: the record as JSON bytes (keys sorted)."""
        obj: dict[str, Any] = {"format": self.format, "step": self.step, "sha256": self.sha256,
                               "created_at": self.created_at}
        if self.name is None:
            obj.update(self.data.fields())
        else:
            obj.update(name=self.name, files=[{"path": f.path, **f.fields()} for f in self.files])
        return json.dumps(obj, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> CommitRecord:
        """:func:`parse_record`."""
        return parse_record(raw)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_digests(obj: dict[str, Any]) -> None:
    """Raise :class:`NewerCheckpointError` for a newer ``format`` or unknown ``digest``, ``ValueError`` if ill-typed."""
    version = obj.get("format", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError("commit record has no valid format (an int >= 1)")
    if version > FORMAT:
        raise NewerCheckpointError(f"format {version} (this release reads formats up to {FORMAT})", format=version)
    files = obj.get("files")
    holders = [f for f in files if isinstance(f, dict)] if isinstance(files, list) else [obj]
    for holder in holders:
        kind = holder.get("digest", "sha256")
        if not isinstance(kind, str):
            raise ValueError(f"commit record's digest must be one of {DIGESTS}")
        if kind not in DIGESTS:
            raise NewerCheckpointError(f"digest {kind!r} (this release knows {', '.join(DIGESTS)})", digest=kind)


def _file_entry(obj: Any, path: str) -> FileEntry:
    """:return: the validated entry of ``obj``'s ``size``, ``chunk_bytes``, ``chunks``, ``digest``."""
    if not isinstance(obj, dict):
        raise ValueError("commit record's files must be JSON objects")
    size, chunk_bytes, chunks = obj.get("size"), obj.get("chunk_bytes"), obj.get("chunks")
    kind = obj.get("digest", "sha256")
    if not _count(size):
        raise ValueError("commit record has no valid step or size")
    if not _count(chunk_bytes) or chunk_bytes < MIN_CHUNK_BYTES:
        raise ValueError(f"commit record has no valid chunk_bytes (an int >= {MIN_CHUNK_BYTES})")
    if not isinstance(chunks, list) or len(chunks) != -(-size // chunk_bytes):
        raise ValueError(f"commit record's hash list does not cover {size} bytes")
    width = HEX_CHARS[kind]
    if not all(isinstance(c, str) and len(c) == width and _HEX.fullmatch(c) for c in chunks):
        raise ValueError("commit record's hash list has an invalid digest")
    return FileEntry(path, size, chunk_bytes, tuple(chunks), kind)


def _folder_files(name: Any, files: Any) -> tuple[FileEntry, ...]:
    """:return: the validated entries of a folder-shape record's ``files``."""
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise ValueError("commit record has no valid name")
    if not isinstance(files, list) or not files:
        raise ValueError("commit record lists no file")
    entries = []
    for item in files:
        path = item.get("path") if isinstance(item, dict) else None
        if not isinstance(path, str) or not (path == name or path.startswith(name + "/")) \
                or any(part in ("", ".", "..") for part in path.split("/")):
            raise ValueError("commit record names a file outside its checkpoint")
        entries.append(_file_entry(item, path))
    if len({e.path for e in entries}) != len(entries):
        raise ValueError("commit record lists a file twice")
    return tuple(entries)


def parse_record(raw: bytes) -> CommitRecord:
    """Parse and validate a commit record of either shape and any known format.

    :param raw: the record's bytes (a reader reads at most :data:`MAX_RECORD_BYTES` + 1 of them).
    :return: the record.
    :raises NewerCheckpointError: a newer release's record (a ``format`` above :data:`FORMAT`, or an unknown
        ``digest``): not to be used, skipped past or deleted.
    :raises ValueError: a torn or malformed record, or one whose hash lists do not cover their sizes or do not
        hash to its ``sha256``."""
    try:
        obj = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"commit record is not valid JSON: {exc!r}"[:200]) from None
    if not isinstance(obj, dict):
        raise ValueError("commit record is not a JSON object")
    _check_digests(obj)
    step, digest = obj.get("step"), obj.get("sha256")
    if not _count(step) or ("files" not in obj and not _count(obj.get("size"))):
        raise ValueError("commit record has no valid step or size")
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise ValueError("commit record has no valid sha256")
    name = None
    if "files" in obj:
        name = obj.get("name")
        files = _folder_files(name, obj.get("files"))
        root = root_digest(f.sha256 for f in files)
    else:
        files = (_file_entry(obj, CheckpointName.build(step, DATA)),)
        root = files[0].sha256
    if root != digest:
        raise ValueError("commit record's sha256 does not match its hash list")
    return CommitRecord(step, files, digest, str(obj.get("created_at", "")), name, obj.get("format", 1))
