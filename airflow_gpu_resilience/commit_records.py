"""The worker's commit records as the provider reads them: which checkpoints a task folder holds.

Pure: a task folder's listing (object name -> size) and a way to read one object's bytes in,
the committed steps out. The record schema, with its ``format`` version, is the one
``docs/worker-contract.rst`` documents ("The task folder's contract"): a checkpoint is committed
once its record (``<checkpoint>.commit.json``, written after the data) names every file with its
size. This module reads it without importing the worker; the repository's shared task-folder
fixtures hold the worker's verifier and this reader to the same answers.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RECORD_DIGESTS", "RECORD_FORMAT", "RECORD_SUFFIX", "NewerRecord", "TaskCheckpoints", "non_negative_int",
           "record_commits", "task_checkpoints"]

#: The commit-record format this reader knows, and the chunk digests a record may name
#: (``docs/worker-contract.rst``, "The commit record"). A record that names a greater format or
#: another digest was written by a newer worker release: :class:`NewerRecord`.
RECORD_FORMAT = 1
#: Hex characters of each chunk digest a record of that format may name, by digest.
_DIGEST_HEX = {"sha256": 64, "crc32c": 8, "crc32": 8}
#: The chunk digests a record of that format may name.
RECORD_DIGESTS = tuple(_DIGEST_HEX)
RECORD_SUFFIX = ".commit.json"
_ONE_FILE_RECORD_RE = re.compile(r"^ckpt-(?P<step>\d{8,})\.commit\.json$")
_LAST_NUMBER_RE = re.compile(r"(\d+)(?!.*\d)")


def non_negative_int(value: Any) -> int | None:
    """``value`` when it is an ``int`` (not a ``bool``) >= 0, else ``None``."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


@dataclass(frozen=True)
class NewerRecord:
    """A commit record of a newer worker release than the schema this provider reads.

    The worker refuses such a task folder (exit 78, a ``FATAL`` marker naming the record) rather
    than resume from an older checkpoint and delete the newer one: the task is FATAL, and
    :meth:`reason` says why.

    :param file: the record's name in the task folder.
    :param format: its ``format`` when that is newer than :data:`RECORD_FORMAT`, else ``None``.
    :param digest: its chunk digest when that is not one of :data:`RECORD_DIGESTS`, else ``None``.
    """

    file: str
    format: int | None = None
    digest: str | None = None

    def reason(self, task_index: int) -> str:
        """:return: one line, e.g. ``task 0: commit record ckpt-00000020.commit.json has format 99, ...``."""
        what = f"format {self.format}" if self.format is not None else f"digest {self.digest!r}"
        return (f"task {task_index}: commit record {self.file} has {what}, written by a newer worker release than "
                "the one that ran (was its image rolled back?); it refuses the folder rather than lose that checkpoint")


@dataclass(frozen=True)
class TaskCheckpoints:
    """What one task folder's commit records say.

    :param task_index: the task.
    :param steps: the committed steps, newest first (records whose files are listed with their sizes).
    :param newer: a newer release's record, when there is one (see :class:`NewerRecord`).
    """

    task_index: int
    steps: tuple[int, ...] = ()
    newer: NewerRecord | None = None

    @property
    def newest_step(self) -> int | None:
        """The newest committed step, or ``None``."""
        return self.steps[0] if self.steps else None


def _newer_part(obj: dict[str, Any], name: str) -> NewerRecord | None | bool:
    """:return: the :class:`NewerRecord` of ``obj`` when a newer release wrote it, ``False`` when its
    ``format`` or a ``digest`` has the wrong type (malformed), else ``None``."""
    version = obj.get("format", 1)
    if non_negative_int(version) is None or version < 1:
        return False
    if version > RECORD_FORMAT:
        return NewerRecord(name, format=version)
    files = obj.get("files")
    for holder in [e for e in files if isinstance(e, dict)] if isinstance(files, list) else [obj]:
        digest = holder.get("digest", "sha256")
        if not isinstance(digest, str):
            return False
        if digest not in RECORD_DIGESTS:
            return NewerRecord(name, digest=digest)
    return None


#: The smallest ``chunk_bytes`` a record may carry.
_MIN_CHUNK_BYTES = 4096
_HEX_RE = re.compile(r"[0-9a-f]+")


def _hash_list_root(entry: dict[str, Any]) -> bytes | None:
    """:return: the root digest (the sha256 of its chunk digests) of one file's entry, ``None`` when
    its hash list is not one the worker would verify: ``chunk_bytes`` below 4 KiB, not one digest
    per ``chunk_bytes`` of ``size``, or a digest of another length or not lowercase hex."""
    size, chunk_bytes, chunks = entry.get("size"), entry.get("chunk_bytes"), entry.get("chunks")
    width = _DIGEST_HEX.get(entry.get("digest", "sha256"))
    if non_negative_int(size) is None or non_negative_int(chunk_bytes) is None or chunk_bytes < _MIN_CHUNK_BYTES:
        return None
    if not isinstance(chunks, list) or len(chunks) != -(-size // chunk_bytes) or not all(
            isinstance(c, str) and len(c) == width and _HEX_RE.fullmatch(c) for c in chunks):
        return None
    return hashlib.sha256(b"".join(bytes.fromhex(c) for c in chunks)).digest()


def _matches_its_hash_lists(obj: dict[str, Any]) -> bool:
    """Whether the record's ``sha256`` is the root of its hash list (one file) or of its files'
    roots (folder shape), each hash list well formed, as the worker checks before it reads data."""
    entries = obj["files"] if isinstance(obj.get("files"), list) else [obj]
    roots = [_hash_list_root(e) if isinstance(e, dict) else None for e in entries]
    if not roots or None in roots:
        return False
    top = roots[0] if "files" not in obj else hashlib.sha256(b"".join(roots)).digest()
    return top.hex() == obj.get("sha256")


def _folder_sizes(obj: dict[str, Any], name: str) -> dict[str, int] | None:
    """:return: path -> size of a folder-shape record named ``name``, ``None`` when malformed."""
    base, files = obj.get("name"), obj.get("files")
    if not isinstance(base, str) or not base or "/" in base or name != base + RECORD_SUFFIX:
        return None
    sizes: dict[str, int] = {}
    for entry in files if isinstance(files, list) else []:
        path = entry.get("path") if isinstance(entry, dict) else None
        if (not isinstance(path, str) or not (path == base or path.startswith(base + "/")) or path in sizes
                or any(part in ("", ".", "..") for part in path.split("/")) or non_negative_int(entry.get("size")) is None):
            return None
        sizes[path] = entry["size"]
    return sizes or None


def record_commits(raw: bytes, name: str) -> tuple[int, dict[str, int]] | NewerRecord | None:
    """What the commit record ``name`` (directly in a task folder) commits, by the documented schema.

    The provider does not hash data (the worker does, on load): a record that parses, has a format
    and digests this provider knows, hash lists that hash to its ``sha256``, and names the step
    (and, folder shape, the name) of its own file name commits the files it lists at their sizes.

    :param raw: the record's bytes.
    :param name: its name in the task folder (``ckpt-{step:08d}.commit.json`` or ``<name>.commit.json``).
    :return: ``(step, {path relative to the task folder: size in bytes})``; a :class:`NewerRecord`
        for a newer release's record; ``None`` for a torn, malformed or mismatched one.
    """
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    newer = _newer_part(obj, name)
    if newer is not None:
        return newer or None
    step = non_negative_int(obj.get("step"))
    if step is None or not _matches_its_hash_lists(obj):
        return None
    if "files" in obj:  # the worker's names carry the step (a framework's prefix, the step, its suffix)
        sizes = _folder_sizes(obj, name)
        numbers = {int(number) for number in re.findall(r"\d+", name[: -len(RECORD_SUFFIX)])}
        return None if sizes is None or step not in numbers else (step, sizes)
    match, size = _ONE_FILE_RECORD_RE.match(name), non_negative_int(obj.get("size"))
    if match is None or int(match.group("step")) != step or size is None:
        return None
    return step, {f"ckpt-{step:08d}.pt": size}


def _by_step(name: str) -> tuple[int, str]:  # the last number in the name, then the name
    numbers = _LAST_NUMBER_RE.search(name[: -len(RECORD_SUFFIX)])
    return (int(numbers.group(1)) if numbers else -1, name)


def task_checkpoints(task_index: int, listing: dict[str, int],
                     read: Callable[[str], bytes | None]) -> TaskCheckpoints:
    """A task folder's committed steps and newer release's record, from its listing.

    Every record directly in the folder is read (a few: the worker keeps the newest
    ``keep_latest_k``); one counts when every file it lists is listed with its size.

    :param task_index: the task.
    :param listing: every object of the task folder: name relative to it -> size in bytes.
    :param read: the bytes of one object by relative name; ``None`` when it is gone.
    :return: the task's :class:`TaskCheckpoints` (the newer record reported is the newest one).
    """
    steps, newer = set(), None
    for name in sorted((n for n in listing if "/" not in n and n.endswith(RECORD_SUFFIX)), key=_by_step, reverse=True):
        raw = read(name)
        found = None if raw is None else record_commits(raw, name)
        if isinstance(found, NewerRecord):
            newer = newer or found
        elif found is not None and all(listing.get(path) == size for path, size in found[1].items()):
            steps.add(found[0])
    return TaskCheckpoints(task_index, tuple(sorted(steps, reverse=True)), newer)
