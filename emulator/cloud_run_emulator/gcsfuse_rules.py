"""The FUSE volume's rules, as pure functions: what a mount's options set, which write streams and
which falls back to a staged write (and why), what a close uploads, when a rewrite counts as
throttled, when a folder rename is refused, and what a file's attributes are.

No I/O and no FUSE library: the mount process (:mod:`.gcsfuse_writes`, :mod:`.gcsfuse_ops`) asks
these functions and does what they say. The rules are gcsfuse's ``docs/semantics.md`` ("Streaming
Writes", "Staged Writes", "Rename", "Files and directories"); the module docstring of
:mod:`.gcsfuse` lists what is emulated and what is not.
"""

from __future__ import annotations

import stat as statmod
from dataclasses import dataclass
from typing import Optional

#: Files that may stream at once before writes fall back to staging (gcsfuse's low-spec default).
DEFAULT_STREAMING_FILES = 4
#: Seconds between two writes of one object name below which a rewrite counts as throttled.
REWRITE_INTERVAL_S = 1.0
#: ``utimensat``'s "now" and "leave as is" (``tv_nsec`` values; libfuse passes them with ``tv_sec`` 0).
UTIME_NOW, UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2
#: Causes of a staged write that follows an upload of the file (the handle writes on).
AFTER_CLOSE, AFTER_RENAME = "write-after-close", "write-after-rename"


@dataclass(frozen=True)
class MountSettings:
    """What one mount does, from its options (see :meth:`from_options`).

    :param strict: a staged-write fallback is ``EIO`` instead.
    :param streaming: new files written in order stream (``enable-streaming-writes``).
    :param stream_limit: files one task may stream at once (``write-global-max-blocks``; ``inf``
        for -1, unlimited).
    :param rename_dir_limit: most objects a folder rename may move (``rename-dir-limit``).
    :param file_mode: permission bits of every file (``file-mode``).
    :param dir_mode: permission bits of every folder (``dir-mode``).
    :param uid: owner of every entry (``uid``; the mounting user for -1).
    :param gid: group of every entry (``gid``; the mounting user's group for -1).
    :param buckets_root: the mount shows one folder per bucket (the emulator's storage root).
    """

    strict: bool = False
    streaming: bool = True
    stream_limit: float = DEFAULT_STREAMING_FILES
    rename_dir_limit: int = 0
    file_mode: int = 0o644
    dir_mode: int = 0o755
    uid: int = 0
    gid: int = 0
    buckets_root: bool = False

    @classmethod
    def from_options(cls, options: dict, strict: bool, buckets_root: bool, uid: int, gid: int) -> "MountSettings":
        """The settings of parsed mount options.

        :param options: ``parse_mount_options(..., emulator=True)``'s dict (name -> value).
        :param strict: the mount process's ``--strict`` (``x-emulator-strict`` in ``options``
            also makes it strict).
        :param buckets_root: see the class.
        :param uid: the mounting user's id, used where ``uid`` is absent or -1.
        :param gid: the mounting user's group id, used where ``gid`` is absent or -1.
        """
        limit = options.get("write-global-max-blocks", DEFAULT_STREAMING_FILES)
        return cls(strict=strict or bool(options.get("x-emulator-strict")),
                   streaming=options.get("enable-streaming-writes", True),
                   stream_limit=float("inf") if limit < 0 else limit,
                   rename_dir_limit=options.get("rename-dir-limit", 0),
                   file_mode=options.get("file-mode", 0o644), dir_mode=options.get("dir-mode", 0o755),
                   uid=options.get("uid", -1) if options.get("uid", -1) >= 0 else uid,
                   gid=options.get("gid", -1) if options.get("gid", -1) >= 0 else gid,
                   buckets_root=buckets_root)


def shows_local_copy(mode: Optional[str], dirty: bool, opened_existing: bool) -> bool:
    """Whether a writer's local copy is what the file is; else (an existing object opened for
    writing with nothing written or cut yet) the object is.

    :param mode: the writer's mode: ``None`` (nothing written yet), ``"stream"`` or ``"staged"``.
    :param dirty: written or cut since its last upload.
    :param opened_existing: it opened an existing object (not a new file).
    """
    return mode is not None or dirty or not opened_existing


def overwrites(opened_existing: bool, base_size: Optional[int]) -> bool:
    """Whether the first write of a writer rewrites an object (a staged ``overwrite``): it opened
    an existing object that is not empty (gcsfuse streams a new file and an empty object).

    :param base_size: the object's size in bytes when it was opened, ``None`` if it was absent.
    """
    return opened_existing and base_size != 0


def stream_refusal(streaming: bool, streaming_now: int, stream_limit: float, offset: int) -> Optional[str]:
    """Why the first write of a file that may stream is staged, or ``None`` when it streams.

    :param streaming: the mount's ``enable-streaming-writes``.
    :param streaming_now: files the writer's task streams now.
    :param stream_limit: :attr:`MountSettings.stream_limit`.
    :param offset: byte offset of the write (a stream starts at 0).
    :returns: ``"streaming-disabled"``, ``"streaming-limit"``, ``"out-of-order-write"`` or ``None``.
    """
    if not streaming:
        return "streaming-disabled"
    if streaming_now >= stream_limit:
        return "streaming-limit"
    if offset != 0:
        return "out-of-order-write"
    return None


def after_upload_cause(cause: Optional[str]) -> str:
    """The staging cause of a write to a non-empty file its handle goes on writing after an
    upload: :data:`AFTER_RENAME` when a rename uploaded it, else :data:`AFTER_CLOSE`.

    :param cause: the writer's cause so far (a rename sets :data:`AFTER_RENAME`).
    """
    return AFTER_RENAME if cause == AFTER_RENAME else AFTER_CLOSE


def truncation_stages(mode: Optional[str], opened_existing: bool, size: int, length: int) -> bool:
    """Whether cutting or extending a file being written to ``length`` falls back to a staged
    write: extending a file that streams (or a new file) only sets its size (gcsfuse's
    streaming writer remembers it); anything else on a file not staged yet stages it.

    :param mode: the writer's mode (see :func:`shows_local_copy`).
    :param size: the file's size now, in bytes.
    :param length: the size asked for, in bytes.
    """
    extends = length > size and (mode == "stream" or mode is None and not opened_existing)
    return mode != "staged" and not extends


def uploads_at_close(mode: Optional[str], opened_existing: bool, dirty: bool, unlinked: bool) -> bool:
    """Whether a close (``flush``) of a writer not uploaded yet uploads it: not when its file
    was deleted, when it opened an existing object and wrote nothing, or when it is staged and
    nothing changed since its last upload (``fsync``). A new file with nothing written is
    uploaded (an empty object).
    """
    if unlinked or mode is None and opened_existing:
        return False
    return not (mode == "staged" and not dirty)


def throttled(last: Optional[float], now: float) -> bool:
    """Whether a write of an object name at ``now`` comes less than :data:`REWRITE_INTERVAL_S`
    after its last write at ``last`` (monotonic seconds; ``None``: never written here).
    Cloud Storage allows about one write per second per object name."""
    return last is not None and now - last < REWRITE_INTERVAL_S


def resolve_times(given: Optional[tuple], old: tuple, now_ns: int) -> tuple:
    """The ``(atime, mtime)`` in ns that a ``utimens`` sets.

    :param given: the two times asked for, in ns (:data:`UTIME_NOW`, :data:`UTIME_OMIT` allowed),
        or ``None`` for "both now".
    :param old: the file's ``(atime, mtime)`` in ns (what :data:`UTIME_OMIT` keeps).
    :param now_ns: the time now, in ns (what :data:`UTIME_NOW` sets).
    """
    given = given or (UTIME_NOW, UTIME_NOW)
    return tuple(now_ns if t == UTIME_NOW else was if t == UTIME_OMIT else t for t, was in zip(given, old))


def rename_dir_refusal(objects: int, limit: int) -> Optional[str]:
    """Why a folder rename is refused (``EMFILE``, gcsfuse's "too many objects to be renamed" on
    a flat bucket), or ``None`` within ``rename-dir-limit``.

    :param objects: objects the rename would move (files and folders below it).
    :param limit: :attr:`MountSettings.rename_dir_limit`.
    """
    if objects > limit:
        return f"EMFILE: {objects} objects > rename-dir-limit {limit}"
    return None


def attributes(st, settings: MountSettings) -> dict:
    """A file's or folder's attributes as the mount shows them (``st_*`` keys, times in ns):
    the mount's modes and owner, the object's time for every time, 1 MiB blocks.

    :param st: an ``os.stat_result`` of the object, local copy or folder.
    :param settings: the mount's settings.
    """
    is_dir = statmod.S_ISDIR(st.st_mode)
    return {
        "st_mode": (statmod.S_IFDIR | settings.dir_mode) if is_dir else (statmod.S_IFREG | settings.file_mode),
        "st_nlink": 2 if is_dir else 1, "st_size": st.st_size,
        "st_uid": settings.uid, "st_gid": settings.gid, "st_atime": st.st_mtime_ns, "st_mtime": st.st_mtime_ns,
        "st_ctime": st.st_mtime_ns, "st_blksize": 1 << 20, "st_blocks": (st.st_size + 511) // 512,
    }
