"""Cloud Storage FUSE semantics for the emulator's ``cloud-storage`` volumes (libfuse3, ``mfusepy``).

On Cloud Run a GCS volume is a bucket mounted through Cloud Storage FUSE (gcsfuse), which is not
POSIX. This module mounts a bucket's folder of the GCS emulator (``gcp-storage-emulator`` keeps
each object as a plain file under ``{data_dir}/gcs/.cloudstorage/{bucket}/``) through a FUSE file
system that behaves the way gcsfuse 3 documents it, so an object appears in that folder (and so
through the Storage API) only when gcsfuse would have created it.

Mount API (stable; the worker's fault suite uses it directly)::

    from airflow_gpu_resilience.emulator.gcsfuse import GcsFuseMount, fuse_available

    ok, why = fuse_available()             # (False, "no /dev/fuse") where FUSE cannot work
    with GcsFuseMount(source=bucket_dir, mountpoint=mnt, state_dir=state,
                      strict=False, options=["rename-dir-limit=10"]) as mount:
        ...                                # write and read under ``mnt``
        mount.events()                     # [{"kind": "staged", "cause": "overwrite", ...}, ...]
        mount.stats()                      # {"staged": 1, "throttled": 0, ..., "bytesRead": {obj: n}}

``source`` is the folder holding the objects (a bucket folder), ``mountpoint`` an empty folder,
``state_dir`` a folder on the same file system as ``source`` (staging files, ``events.jsonl``).
The file system runs in its own process (``python -m airflow_gpu_resilience.emulator.gcsfuse``),
which unmounts itself when it gets SIGTERM or when its parent process dies (even by SIGKILL);
:meth:`GcsFuseMount.stop` and :func:`unmount_stale` lazily unmount (``fusermount3 -u -z``).

What is emulated (gcsfuse ``docs/semantics.md``, "Streaming Writes" and "Staged Writes"):

- **Streaming writes** (the default): a new file written sequentially becomes an object only when
  it is closed (the ``flush`` of ``close()``); ``fsync`` does not finalize it; an error of the
  upload (``ESTALE``) is the error of ``close()``. A killed writer's file is closed by the kernel
  and finalized as a short object.
- **Staged writes**: everything else falls back to a full temporary copy, which on Cloud Run is
  memory. Causes recorded: ``overwrite`` (writing an existing object), ``truncate``,
  ``out-of-order-write``, ``read-while-writing`` (a read of a file still streaming finalizes it
  first), ``write-after-close``, ``write-after-rename`` (a file renamed while open for writing
  is uploaded, then renamed; the handle's next write is a staged rewrite of the renamed object),
  ``streaming-limit`` (more than ``write-global-max-blocks``, default 4, -1 unlimited, files
  streaming at once on one task's mount: on the emulator's shared mount, the files of one
  execution, task index and attempt) and ``streaming-disabled`` (``enable-streaming-writes=false``).
  A staged file is uploaded at ``close()`` and also at ``fsync``. An existing object opened for
  writing is the object (its size, its bytes) until a write or truncation fetches it into the
  local copy.
- **Strict mode** (``strict=True``, the emulator's ``--fuse-strict`` or ``EMULATOR_FUSE_STRICT=1``,
  or the volume mount option ``x-emulator-strict``, which only the emulator accepts): the operation
  that would fall back to staging fails with ``EIO`` instead (the write, the truncate, the read
  while writing), and nothing is staged.
- **Rename** of a file is a copy then a delete (both names exist for a moment): recorded as
  ``non-atomic-rename``. A directory rename is refused with ``EMFILE`` (gcsfuse's "too many objects
  to be renamed" on a flat bucket) when the folder holds more objects than ``rename-dir-limit``
  (default 0); within the limit it is a copy and delete of every object, also recorded.
- **Rewrite rate**: the same object name finalized again less than one second after its last
  write is recorded as ``throttled-rewrite`` (Cloud Storage allows about one write per second per
  object name; a real mount retries with backoff, so such a close would take longer). The
  emulator does not delay it, so tests stay fast; the record is what a test checks.
- **Two writers of one object**: every task has its own mount on Cloud Run, so the writers here
  are per task (a writer's ``CLOUD_RUN_EXECUTION``, task index and attempt; processes without
  them count as one task): the handles one task opens on a file it is writing share that file
  (gcsfuse's one inode per mount), and the writers of two tasks, or of two mounts, are separate:
  the first close wins, and a writer whose object changed since it opened it gets ``ESTALE`` at
  close (recorded as ``estale``). ``renameat2`` flags are refused (``EINVAL``), as by gcsfuse;
  a folder holding a file not uploaded yet cannot be renamed (``ENOTSUP``) or removed
  (``ENOTEMPTY``).
- **Metadata**: ``utime`` (``touch``, ``cp -p``) sets the object's modification time, or the
  local copy's, uploaded with it; it is not a new generation, so no writer gets ``ESTALE`` for it.
  An unlinked open file leaves no object (libfuse's ``hard_remove``: its reads, writes and close
  go on; ``fstat`` of it is ``ESTALE``, a limit of libfuse's path-based API).
- **Reads** go to the bucket folder on every open (no cache kept across opens); bytes read per
  object are counted (``read`` records at each close of a reading handle, and
  :meth:`GcsFuseMount.stats` ``bytesRead``).

Every record in ``events.jsonl`` is one JSON object: ``kind`` (``staged``, ``throttled-rewrite``,
``non-atomic-rename``, ``estale``, ``read``), ``object`` (and ``bucket`` on the emulator's mounts
of all buckets), ``time`` (epoch s), ``cause`` and
``bytes`` where they apply, and the writer's ``execution``, ``taskIndex`` and ``attempt`` (from its
``CLOUD_RUN_*`` environment) or ``pid``.

Accepted mount options (gcsfuse flags without ``--``, validated with their values by
:func:`airflow_gpu_resilience.mount_options.parse_mount_options`, the job spec's rules):
``implicit-dirs``, ``only-dir``, ``file-mode``, ``dir-mode``, ``uid``, ``gid``,
``rename-dir-limit``, ``enable-streaming-writes``, ``write-global-max-blocks``,
``metadata-cache-ttl-secs``, ``stat-cache-max-size-mb``, ``type-cache-max-size-mb``,
``kernel-list-cache-ttl-secs``, ``max-conns-per-host``, ``log-severity``; only ``only-dir`` (the
task sees that folder of the bucket), ``rename-dir-limit``, ``enable-streaming-writes``,
``write-global-max-blocks``, ``file-mode``, ``dir-mode``, ``uid`` and ``gid`` change what the
emulated mount does. Not emulated: caches and their TTLs, HNS buckets, symbolic links,
``readOnly``. A limit of serving every task from one mount: the kernel keeps one size per file
for all of them, so two tasks writing the same object at the same time can see each other's size
(an append of one lands at the other's length, an ``O_TRUNC`` of one cuts the other's reads);
separate mounts (two ``GcsFuseMount`` objects, or volumes with other mount options) do not share it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import stat as statmod
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from airflow_gpu_resilience.mount_options import mount_key, parse_mount_options

#: Files that may stream at once before writes fall back to staging (gcsfuse's low-spec default).
DEFAULT_STREAMING_FILES = 4
#: Seconds between two writes of one object name below which a rewrite counts as throttled.
REWRITE_INTERVAL_S = 1.0
EVENT_KINDS = ("staged", "throttled-rewrite", "non-atomic-rename", "estale", "read")


def fuse_available() -> tuple:
    """``(True, "")`` when a FUSE mount can work here, else ``(False, reason)``: not Linux, no
    ``/dev/fuse``, no ``fusermount3``, or ``mfusepy``/libfuse3 not importable."""
    if not sys.platform.startswith("linux"):
        return False, f"not Linux ({sys.platform})"
    if not os.path.exists("/dev/fuse"):
        return False, "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return False, "no fusermount3 (Debian package fuse3)"
    import ctypes
    import importlib.util

    if importlib.util.find_spec("mfusepy") is None:
        return False, "mfusepy is not installed (the emulator extra)"
    try:  # dlopen by soname: importing mfusepy would search for it with ldconfig (slow)
        ctypes.CDLL("libfuse3.so.3")
    except OSError as exc:
        return False, f"libfuse3 missing ({exc}; Debian package libfuse3-3)"
    return True, ""


def _unescape(field: str) -> str:
    """A path field of ``/proc/self/mounts``: the kernel writes space, tab, newline and backslash
    as octal escapes (``\\040``, ``\\011``, ``\\012``, ``\\134``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mount_points(fs_prefix: str = "") -> list:
    """Mount points (unescaped) of ``/proc/self/mounts`` whose file system type starts with ``fs_prefix``."""
    with open("/proc/self/mounts") as mounts:
        return [_unescape(parts[1]) for parts in (line.split() for line in mounts)
                if len(parts) > 2 and parts[2].startswith(fs_prefix)]


def _mounted(path: str) -> bool:
    try:
        return path in _mount_points()
    except OSError:
        return os.path.ismount(path)


def lazy_unmount(path) -> None:
    """``fusermount3 -u -z path`` (quietly; nothing when it is not mounted)."""
    path = str(path)
    if _mounted(path):
        subprocess.run(["fusermount3", "-u", "-z", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=False)


def unmount_stale(under) -> list:
    """Lazily unmount every FUSE mount below folder ``under`` (left by a hard-killed run).

    :returns: the mount points unmounted.
    """
    prefix = str(Path(under).resolve()).rstrip("/") + "/"
    try:
        found = [point for point in _mount_points("fuse") if point.startswith(prefix)]
    except OSError:
        return []
    for point in found:
        lazy_unmount(point)
    return found


def read_events(path) -> list:
    """Records of an ``events.jsonl`` file (a torn last line is skipped)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def summarize(events: list) -> dict:
    """``{"staged", "stagedBytes", "throttled", "nonAtomicRenames", "estale", "bytesRead": {object: n},
    "causes": {cause: n}}`` of a list of records (objects named ``bucket/object`` where records
    name their bucket)."""
    out = {"staged": 0, "stagedBytes": 0, "throttled": 0, "nonAtomicRenames": 0, "estale": 0, "bytesRead": {},
           "causes": {}}
    for ev in events:
        kind = ev.get("kind")
        if kind == "staged":
            out["staged"] += 1
            out["stagedBytes"] += int(ev.get("bytes") or 0)
            out["causes"][ev.get("cause")] = out["causes"].get(ev.get("cause"), 0) + 1
        elif kind == "throttled-rewrite":
            out["throttled"] += 1
        elif kind == "non-atomic-rename":
            out["nonAtomicRenames"] += 1
        elif kind == "estale":
            out["estale"] += 1
        elif kind == "read":
            key = f"{ev['bucket']}/{ev['object']}" if "bucket" in ev else ev["object"]
            out["bytesRead"][key] = out["bytesRead"].get(key, 0) + int(ev.get("bytes") or 0)
    return out


class GcsFuseMount:
    """One gcsfuse-like mount of ``source`` at ``mountpoint``, served by a child process.

    :param source: folder of objects (a bucket folder of the GCS emulator).
    :param mountpoint: folder to mount on (created when missing).
    :param state_dir: folder for staging files and ``events.jsonl``; must be on the file system of
        ``source`` (finalizing is a rename into ``source``).
    :param strict: staging becomes ``EIO`` (see the module docstring).
    :param options: gcsfuse mount options (strings, see :func:`parse_mount_options`).
    :param start_timeout: seconds to wait for the mount to appear.
    :param buckets_root: ``source`` holds one folder per bucket (the emulator's storage root):
        the first path component is the bucket (records get ``bucket``), and nothing but buckets
        may be made at the top (``EACCES``).
    :raises ValueError: for a bad mount option (before anything is started); from :meth:`start`,
        when ``state_dir`` is not on the file system of ``source``.
    """

    def __init__(self, source, mountpoint, state_dir, strict: bool = False, options=(),
                 start_timeout: float = 15.0, buckets_root: bool = False) -> None:
        self.options = list(options or ())
        parse_mount_options(self.options, "options", emulator=True)
        self.source = Path(source).resolve()
        self.mountpoint = Path(mountpoint).resolve()
        self.state_dir = Path(state_dir).resolve()
        self.strict = strict
        self.buckets_root = buckets_root
        self.start_timeout = start_timeout
        self.events_path = self.state_dir / "events.jsonl"
        self.log_path = self.state_dir / "mount.log"
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "GcsFuseMount":
        """Mount; returns when the mount answers.

        :raises ValueError: when ``state_dir`` is on another file system than ``source`` (every
            close would fail with ``EXDEV``).
        :raises RuntimeError: when the file system process ends or does not mount in time.
        """
        self.source.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "staging").mkdir(parents=True, exist_ok=True)
        if os.stat(self.state_dir).st_dev != os.stat(self.source).st_dev:
            raise ValueError(f"state_dir {self.state_dir} is not on the file system of source {self.source}: "
                             f"a close publishes the staging file by a rename into source.")
        lazy_unmount(self.mountpoint)
        argv = [sys.executable, "-m", "airflow_gpu_resilience.emulator.gcsfuse", "--source", str(self.source),
                "--mountpoint", str(self.mountpoint), "--state-dir", str(self.state_dir)]
        argv += ["--strict"] if self.strict else []
        argv += ["--buckets-root"] if self.buckets_root else []
        for option in self.options:
            argv += ["--option", option]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while not _mounted(str(self.mountpoint)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
                raise RuntimeError(f"FUSE mount of {self.source} at {self.mountpoint} failed: {tail}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Unmount (SIGTERM to the file system process, then a lazy unmount) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        lazy_unmount(self.mountpoint)

    def __enter__(self) -> "GcsFuseMount":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def events(self) -> list:
        """Every record so far (see the module docstring)."""
        return read_events(self.events_path)

    def stats(self) -> dict:
        """Counts of the records so far (see :func:`summarize`)."""
        return summarize(self.events())


class VolumeMounts:
    """The emulator's ``cloud-storage`` volumes: one FUSE mount of the whole storage root (every
    bucket folder) per set of mount options per emulator, made when the first attempt that needs
    it starts and kept until the emulator stops; a task sees ``{mount}/{bucket}``.

    Why per emulator and not per execution or per bucket: a mount costs a process start (about
    0.3 s, 20 MB) that would be added to every attempt or every bucket (the tests make a bucket per
    test), and the semantics a worker must meet are per task (the file system keeps each task's
    writers apart, so two tasks sharing a mount still see "first close wins" and ``ESTALE``); reads
    keep no cache across opens, so a shared mount hides no download. Volumes with different mount
    options (or strictness) get different mounts.

    :param data_dir: the emulator's data folder; mounts go under ``data_dir/fuse/``.
    :param bucket_dir: ``callable(bucket) -> Path``, the bucket's folder of objects.
    :param mode: ``"auto"`` (FUSE when available, else folders), ``"fuse"`` or ``"folder"``.
    :param strict: strict mode for every mount (see the module docstring).
    :raises ValueError: for a ``mode`` not in ``auto``, ``fuse``, ``folder``.
    """

    MODES = ("auto", "fuse", "folder")

    def __init__(self, data_dir, bucket_dir, mode: str = "auto", strict: bool = False) -> None:
        if mode not in self.MODES:
            raise ValueError(f"volumes: '{mode}' is not one of {', '.join(self.MODES)}.")
        self.root = Path(data_dir).resolve() / "fuse"
        self.bucket_dir = bucket_dir
        self.strict = strict
        available, why = fuse_available() if mode != "folder" else (False, "folders requested")
        self.fuse = available
        self.reason = why
        self._mu = threading.Lock()
        self._mounts: dict = {}
        if mode == "fuse" and not available:
            raise RuntimeError(f"volumes: FUSE requested but unavailable: {why}.")

    @property
    def kind(self) -> str:
        """``"fuse"`` or ``"folder"``."""
        return "fuse" if self.fuse else "folder"

    def banner(self) -> str:
        """The one line the emulator logs at start about its volumes."""
        if self.fuse:
            return (f"cloud-storage volumes: FUSE mounts with Cloud Storage FUSE semantics"
                    f"{' (strict mode: staging is EIO)' if self.strict else ''}")
        return f"cloud-storage volumes: plain folders, FUSE unavailable ({self.reason}); gcsfuse semantics not emulated"

    def start(self) -> None:
        """Clear mounts a hard-killed emulator left under this data folder."""
        if self.fuse:
            unmount_stale(self.root)

    def local_dir(self, bucket: str, options=()) -> Path:
        """The folder a task sees for ``bucket`` mounted with ``options`` (mounted on first use).

        :raises ValueError: for a bad mount option.
        :raises RuntimeError: when the mount fails.
        """
        source = Path(self.bucket_dir(bucket))
        options = list(options or ())
        parsed = parse_mount_options(options, "mountOptions", emulator=True)
        only_dir = parsed.pop("only-dir", "")
        source.mkdir(parents=True, exist_ok=True)  # the mount makes nothing but objects in buckets
        if only_dir:  # gcsfuse mounts a prefix that holds no object yet as an empty folder
            (source / only_dir).mkdir(parents=True, exist_ok=True)
        if not self.fuse:  # folders: the bucket's folder, or its only-dir folder
            return source / only_dir if only_dir else source
        key = mount_key(parsed)  # only-dir is a folder of the same mount
        with self._mu:
            mount = self._mounts.get(key)
            if mount is None or mount.proc is None or mount.proc.poll() is not None:
                import hashlib

                digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:10]
                base = self.root / f"mount-{digest}"
                mount = GcsFuseMount(source.parent, base / "mnt", base / "state", strict=self.strict,
                                     options=[o for o in options if not o.startswith("only-dir=")],
                                     buckets_root=True)
                mount.start()
                self._mounts[key] = mount
            return mount.mountpoint / bucket / only_dir if only_dir else mount.mountpoint / bucket

    def events(self, execution: Optional[str] = None, task_index: Optional[int] = None,
               attempt: Optional[int] = None) -> list:
        """Records of every mount, oldest first, optionally only those of one execution (its
        short id), task index and attempt."""
        with self._mu:
            paths = [m.events_path for m in self._mounts.values()]
        found = []
        for path in paths:
            for ev in read_events(path):
                if execution is not None and ev.get("execution") != execution:
                    continue
                if task_index is not None and ev.get("taskIndex") != task_index:
                    continue
                if attempt is not None and ev.get("attempt") != attempt:
                    continue
                found.append(ev)
        return sorted(found, key=lambda ev: ev.get("time", 0))

    def describe(self) -> dict:
        """``{"type", "reason", "strict", "mounts": [{"mountOptions", "mountpoint", "strict"}],
        "summary": summarize(all events)}`` (a bucket's folder is ``{mountpoint}/{bucket}``, and
        ``{mountpoint}/{bucket}/{only-dir}`` with that option; the top ``strict`` is the
        emulator's ``--fuse-strict``, a mount's also counts its ``x-emulator-strict`` option)."""
        with self._mu:
            mounts = [{"mountOptions": list(m.options), "mountpoint": str(m.mountpoint),
                       "strict": m.strict or bool(parse_mount_options(m.options, emulator=True).get("x-emulator-strict"))}
                      for m in self._mounts.values()]
        return {"type": self.kind, "reason": self.reason, "strict": self.strict, "mounts": mounts,
                "summary": summarize(self.events())}

    def stop(self) -> None:
        """Unmount everything (also what a hard-killed run left)."""
        with self._mu:
            mounts, self._mounts = list(self._mounts.values()), {}
        for mount in mounts:
            mount.stop()
        if self.fuse:
            unmount_stale(self.root)


def event_line(ev: dict) -> str:
    """One human-readable log line of a record."""
    extra = " ".join(f"{k}={ev[k]}" for k in ("cause", "bytes", "to", "refused", "seconds") if k in ev)
    who = f"task{ev['taskIndex']}-attempt{ev['attempt']}" if "taskIndex" in ev and "attempt" in ev else f"pid {ev.get('pid')}"
    name = f"{ev['bucket']}/{ev.get('object')}" if "bucket" in ev else ev.get("object")
    return f"gcsfuse {ev.get('kind')}: {name} {extra} ({who})".rstrip()


# --------------------------------------------------------------------------------------------
# The file system (runs in the mount process)
# --------------------------------------------------------------------------------------------

class _Writer:
    """A file open for writing on one task's mount (gcsfuse's inode): its local copy (a staging
    file) and its state, shared by every handle that task opens on it while it is being written
    (``refs``); another task's open of the same object is another writer (another mount)."""

    __slots__ = ("path", "fd", "temp", "base", "mode", "cause", "next_offset", "who", "finalized", "dirty",
                 "unlinked", "reads", "opened_existing", "refs")

    def __init__(self, path, fd, temp, base, who, opened_existing):
        self.path, self.fd, self.temp, self.base, self.who = path, fd, temp, base, who
        self.mode = None  # None: nothing written yet; "stream" | "staged"
        self.cause = None
        self.next_offset = 0
        self.finalized = False
        self.dirty = False
        self.unlinked = False
        self.reads = 0
        self.opened_existing = opened_existing
        self.refs = 1


class _Reader:
    __slots__ = ("path", "fd", "bytes", "who")

    def __init__(self, path, fd, who):
        self.path, self.fd, self.bytes, self.who = path, fd, 0, who


def _generation(path: str):
    """What identifies an object's generation here: (inode, mtime, size), or None if absent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size) if statmod.S_ISREG(st.st_mode) else None


def _identity(pid: int) -> dict:
    """The caller's ``CLOUD_RUN_*`` identity from its environment, else its pid."""
    who = {"pid": pid}
    try:
        with open(f"/proc/{pid}/environ", "rb") as env:
            for item in env.read().split(b"\0"):
                key, _, value = item.partition(b"=")
                if key == b"CLOUD_RUN_EXECUTION":
                    who["execution"] = value.decode(errors="replace")
                elif key == b"CLOUD_RUN_TASK_INDEX" and value.isdigit():
                    who["taskIndex"] = int(value)
                elif key == b"CLOUD_RUN_TASK_ATTEMPT" and value.isdigit():
                    who["attempt"] = int(value)
    except OSError:
        pass
    return who


def _task_of(who: dict):
    """``(execution, task index, attempt)`` of a writer's identity, ``None`` outside a task."""
    return (who["execution"], who.get("taskIndex"), who.get("attempt")) if "execution" in who else None


#: ``utimensat``'s "now" and "leave as is" (``tv_nsec`` values; libfuse passes them with ``tv_sec`` 0).
_UTIME_NOW, _UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2


def _make_fs(source: str, state_dir: str, strict: bool, options: dict, buckets_root: bool = False):
    import mfusepy

    FuseOSError = mfusepy.FuseOSError

    class GcsFuseOperations(mfusepy.Operations):
        use_ns = True

        def __init__(self):
            self.root = source.rstrip("/")
            self.staging = os.path.join(state_dir, "staging")
            self.events = open(os.path.join(state_dir, "events.jsonl"), "a", buffering=1)
            self.strict = strict or bool(options.get("x-emulator-strict"))
            self.streaming = options.get("enable-streaming-writes", True)
            limit = options.get("write-global-max-blocks", DEFAULT_STREAMING_FILES)
            self.stream_limit = float("inf") if limit < 0 else limit
            self.rename_dir_limit = options.get("rename-dir-limit", 0)
            self.file_mode = options.get("file-mode", 0o644)
            self.dir_mode = options.get("dir-mode", 0o755)
            self.uid = options.get("uid", -1) if options.get("uid", -1) >= 0 else os.getuid()
            self.gid = options.get("gid", -1) if options.get("gid", -1) >= 0 else os.getgid()
            self._mu = threading.RLock()
            self.handles: dict = {}
            self.next_fh = 1
            self.last_write: dict = {}  # object name -> monotonic time of its last finalize
            self.counter = 0

        # --- helpers ---------------------------------------------------------------------
        def _real(self, path: str) -> str:
            return self.root + path

        def _top(self, path: str) -> None:
            """Nothing but buckets at the top of a buckets-root mount."""
            if buckets_root and path.count("/") <= 1:
                raise FuseOSError(errno.EACCES)

        def _who(self) -> dict:
            return _identity(mfusepy.fuse_get_context()[2])

        def _record(self, kind: str, obj: str, who: Optional[dict] = None, **fields) -> None:
            name = obj.lstrip("/")
            bucket = {}
            if buckets_root:
                head, _, name = name.partition("/")
                bucket = {"bucket": head}
                if "to" in fields:
                    fields["to"] = fields["to"].partition("/")[2]
            event = {"kind": kind, **bucket, "object": name, "time": round(time.time(), 6), **fields}
            event.update(who or {})
            try:
                self.events.write(json.dumps(event) + "\n")
            except (OSError, ValueError) as exc:  # a full disk: the operation itself has happened
                print(f"gcsfuse: record lost ({exc}): {event}", file=sys.stderr, flush=True)

        def _add(self, handle) -> int:
            with self._mu:
                fh = self.next_fh
                self.next_fh += 1
                self.handles[fh] = handle
                return fh

        def _writers(self, path: str) -> list:
            return [h for h in self.handles.values() if isinstance(h, _Writer) and h.path == path
                    and not h.finalized and not h.unlinked]

        def _mine(self, path: str, who: dict) -> list:
            """Writers of ``path`` on the mount of ``who``'s task (see :func:`_task_of`)."""
            task = _task_of(who)
            return [w for w in self._writers(path) if _task_of(w.who) == task]

        def _open_of(self, path: str, who: dict) -> list:
            """Every writer of ``path`` ``who``'s task has open, also one a close has uploaded
            while another handle keeps it open (gcsfuse's inode of that mount)."""
            task = _task_of(who)
            return [h for h in self.handles.values() if isinstance(h, _Writer) and h.path == path
                    and not h.unlinked and _task_of(h.who) == task]

        def _private_copy(self, w: _Writer) -> None:
            """After a close published ``w``'s local copy itself (a streaming file), give ``w`` a
            copy of those bytes to go on with."""
            if w.temp is None:
                temp, fd = self._temp()
                size = os.fstat(w.fd).st_size
                os.sendfile(fd, w.fd, 0, size) if size else None
                os.close(w.fd)
                w.fd, w.temp = fd, temp

        def _temp(self) -> tuple:
            with self._mu:
                self.counter += 1
                name = os.path.join(self.staging, f"{os.getpid()}-{self.counter}")
            return name, os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)

        def _streaming_now(self, who: dict) -> int:
            """Files streaming now on the mount ``who`` writes through: on Cloud Run each task
            has its own mount, so on the emulator's shared mount the files of ``who``'s task
            (execution, task index, attempt); writers without a task share one count."""
            task = _task_of(who)
            return sum(1 for h in self.handles.values() if isinstance(h, _Writer) and h.mode == "stream"
                       and not h.finalized and _task_of(h.who) == task)

        @staticmethod
        def _local(w: _Writer) -> bool:
            """Whether ``w``'s local copy is what the file is (else, an existing object opened for
            writing with nothing written yet, the object is)."""
            return w.mode is not None or w.dirty or not w.opened_existing

        def _stage(self, w: _Writer, cause: str, fetch: bool = True) -> None:
            """Fall back to a staged write for ``w`` (or EIO in strict mode); ``fetch``: an
            existing object's bytes are copied into the local copy first (not for a truncation
            on open, which starts from empty)."""
            if self.strict:
                self._record("staged", w.path, w.who, cause=cause, bytes=0, refused="EIO (strict mode)")
                raise FuseOSError(errno.EIO)
            if fetch and w.opened_existing and not w.dirty and w.mode is None:
                # the local copy of an existing object: the whole object is fetched first
                src = _generation(self._real(w.path))
                if src is not None:
                    with open(self._real(w.path), "rb") as f:
                        os.ftruncate(w.fd, 0)
                        os.sendfile(w.fd, f.fileno(), 0, src[2]) if src[2] else None
                    w.reads += src[2]  # a download of the whole object
            w.mode, w.cause = "staged", cause

        def _begin_stream(self, w: _Writer, offset: int) -> None:
            """The first write of a file that may stream: it streams unless streaming is off,
            the task streams as many files as it may, or the write is not at offset 0."""
            if not self.streaming:
                self._stage(w, "streaming-disabled")
            elif self._streaming_now(w.who) >= self.stream_limit:
                self._stage(w, "streaming-limit")
            elif offset != 0:
                self._stage(w, "out-of-order-write")
            else:
                w.mode, w.cause, w.next_offset = "stream", None, 0

        def _finalize(self, w: _Writer, keep: bool = False) -> None:
            """Upload ``w``'s local copy as the object (a rename into the bucket folder); with
            ``keep`` (and always for a staged file, which may be written on after ``fsync``)
            a copy is published and the local copy stays ``w``'s.

            :raises FuseOSError: ``ESTALE`` when the object changed since ``w`` opened it."""
            if w.unlinked:  # its task deleted it: nothing is uploaded
                return
            real = self._real(w.path)
            current = _generation(real)
            if current != w.base:
                self._record("estale", w.path, w.who, cause="the object changed since it was opened")
                w.finalized = True
                self._drop(w)
                raise FuseOSError(errno.ESTALE)
            size = os.fstat(w.fd).st_size
            now = time.monotonic()
            last = self.last_write.get(w.path)
            if last is not None and now - last < REWRITE_INTERVAL_S:
                self._record("throttled-rewrite", w.path, w.who, seconds=round(now - last, 3))
            if w.mode == "staged":
                self._record("staged", w.path, w.who, cause=w.cause, bytes=size)
            os.makedirs(os.path.dirname(real), exist_ok=True)
            if keep or w.mode == "staged":
                tmp, fd = self._temp()
                try:
                    os.sendfile(fd, w.fd, 0, size) if size else None
                    local = os.fstat(w.fd)  # the object's time is its local copy's (utimens)
                    os.utime(fd, ns=(local.st_atime_ns, local.st_mtime_ns))
                finally:
                    os.close(fd)
                os.rename(tmp, real)
            else:
                os.rename(w.temp, real)
                w.temp = None
            self.last_write[w.path] = now
            w.base = _generation(real)
            w.dirty = False

        def _drop(self, w: _Writer) -> None:
            if w.temp is not None:
                try:
                    os.unlink(w.temp)
                except FileNotFoundError:
                    pass
                w.temp = None

        def _attrs(self, st, size=None) -> dict:
            is_dir = statmod.S_ISDIR(st.st_mode)
            return {
                "st_mode": (statmod.S_IFDIR | self.dir_mode) if is_dir else (statmod.S_IFREG | self.file_mode),
                "st_nlink": 2 if is_dir else 1, "st_size": st.st_size if size is None else size,
                "st_uid": self.uid, "st_gid": self.gid, "st_atime": st.st_mtime_ns, "st_mtime": st.st_mtime_ns,
                "st_ctime": st.st_mtime_ns, "st_blksize": 1 << 20, "st_blocks": (st.st_size + 511) // 512,
            }

        # --- metadata -------------------------------------------------------------------------
        def init_with_config(self, conn_info, config_3):
            if conn_info is not None:
                conn_info.max_write = 1 << 20
                conn_info.max_readahead = 1 << 20
            if config_3 is not None:
                config_3.attr_timeout = 1.0
                config_3.entry_timeout = 1.0
                config_3.negative_timeout = 0.0
                # an unlinked open file is gone at once (gcsfuse deletes the object), not renamed to
                # a .fuse_hidden* object by libfuse; its handle's reads, writes and close come without
                # a path (libfuse's high-level API then answers fstat of it with ESTALE)
                config_3.hard_remove = 1

        def getattr(self, path, fh=None):
            with self._mu:
                h = self.handles.get(fh) if fh is not None else None
                if isinstance(h, _Writer) and self._local(h) or h is not None and path is None:
                    return self._attrs(os.fstat(h.fd))  # fstat of an open file (also unlinked)
                if path is None:
                    raise FuseOSError(errno.ENOENT)
                shown = [w for w in self._writers(path) if self._local(w)]
                if shown:  # what this file is to its task: the local copy, size as written
                    shown = [w for w in self._mine(path, self._who()) if self._local(w)]
                if shown:
                    return self._attrs(os.fstat(shown[-1].fd))
            try:
                st = os.lstat(self._real(path))
            except FileNotFoundError:
                raise FuseOSError(errno.ENOENT) from None
            if statmod.S_ISLNK(st.st_mode):
                raise FuseOSError(errno.ENOENT)
            return self._attrs(st)

        def readdir(self, path, fh):
            real = self._real(path)
            try:
                names = [e.name for e in os.scandir(real) if not e.is_symlink()]
            except FileNotFoundError:
                raise FuseOSError(errno.ENOENT) from None
            prefix = path.rstrip("/") + "/"
            with self._mu:
                pending = [h for h in self.handles.values() if isinstance(h, _Writer) and not h.finalized
                           and not h.unlinked and h.path.startswith(prefix)]
                if pending:  # the caller's task's files not uploaded yet (another task's mount shows none)
                    task = _task_of(self._who())
                    for h in pending:
                        rest = h.path[len(prefix):]
                        if _task_of(h.who) == task and "/" not in rest and rest not in names:
                            names.append(rest)
            return [".", ".."] + names

        def statfs(self, path):
            sv = os.statvfs(self.root)
            return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                               "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

        def mkdir(self, path, mode):
            self._top(path)
            try:
                os.mkdir(self._real(path))
            except FileExistsError:
                raise FuseOSError(errno.EEXIST) from None
            except FileNotFoundError:
                raise FuseOSError(errno.ENOENT) from None

        def _local_files_under(self, path: str) -> list:
            """Files below folder ``path`` being written that are no object yet (gcsfuse's
            local files: a folder holding one cannot be removed or renamed)."""
            prefix = path.rstrip("/") + "/"
            with self._mu:
                return [w.path for w in self.handles.values() if isinstance(w, _Writer) and not w.unlinked
                        and w.path.startswith(prefix) and not w.opened_existing
                        and not os.path.exists(self._real(w.path))]

        def rmdir(self, path):
            self._top(path)
            if self._local_files_under(path):
                raise FuseOSError(errno.ENOTEMPTY)
            try:
                os.rmdir(self._real(path))
            except OSError as exc:
                raise FuseOSError(exc.errno) from None

        def unlink(self, path):
            with self._mu:
                # the caller's task's writers upload nothing now; another task's get ESTALE at close
                pending = self._open_of(path, self._who())
                for w in pending:
                    w.unlinked = True
            try:
                os.unlink(self._real(path))
            except FileNotFoundError:
                if not pending:
                    raise FuseOSError(errno.ENOENT) from None
            except IsADirectoryError:
                raise FuseOSError(errno.EISDIR) from None

        def chmod(self, path, mode):
            return 0

        def chown(self, path, uid, gid):
            return 0

        def utimens(self, path, times=None):
            """Set the object's modification time (gcsfuse keeps it in the object's metadata: a
            metadata update, not a new generation, so open writers keep their base)."""
            if path is None:
                return 0
            real = self._real(path)
            with self._mu:
                local = [w for w in self._writers(path) if self._local(w)]  # uploaded with it at close
                before = _generation(real)
                if before is None and not local:
                    raise FuseOSError(errno.ENOENT)
                st = os.fstat(local[-1].fd) if local else os.stat(real)
                now = time.time_ns()
                given = times or (_UTIME_NOW, _UTIME_NOW)
                ns = tuple(now if t == _UTIME_NOW else old if t == _UTIME_OMIT else t
                           for t, old in zip(given, (st.st_atime_ns, st.st_mtime_ns)))
                for w in local:
                    os.utime(w.fd, ns=ns)
                if before is not None:
                    os.utime(real, ns=ns)
                after = _generation(real)
                for h in self.handles.values():
                    if isinstance(h, _Writer) and h.path == path and h.base == before:
                        h.base = after
            return 0

        def rename(self, old, new):
            self._top(old)
            self._top(new)
            real_old, real_new = self._real(old), self._real(new)
            who = self._who()
            with self._mu:
                # the caller's task's file still being written is uploaded first (its writer keeps
                # it); another task's writer of the old name gets ESTALE at close
                moved = self._mine(old, who)
                for w in moved:
                    if self._local(w):
                        self._finalize(w, keep=True)
                before = _generation(real_old)
            if os.path.isdir(real_old):
                self._rename_dir(old, new, who)
                return 0
            if not os.path.exists(real_old):
                raise FuseOSError(errno.ENOENT)
            if os.path.isdir(real_new):
                raise FuseOSError(errno.EISDIR)
            size = os.path.getsize(real_old)
            self._copy_object(real_old, real_new)
            os.unlink(real_old)
            with self._mu:
                now = time.monotonic()
                last = self.last_write.get(new)
                if last is not None and now - last < REWRITE_INTERVAL_S:  # the copy writes that name
                    self._record("throttled-rewrite", new, who, seconds=round(now - last, 3))
                self.last_write[new] = now
                after = _generation(real_new)
                for w in moved:
                    # the handle now writes the renamed object: a write is a staged rewrite of it
                    if self._local(w):
                        w.finalized, w.cause, w.dirty, w.base = True, "write-after-rename", False, after
                    elif w.base == before:
                        w.base = after
                    w.path = new
            self._record("non-atomic-rename", old, who, to=new.lstrip("/"), bytes=size)
            return 0

        def _copy_object(self, real_old, real_new):
            """The copy of a rename: the new name appears while the old one still exists."""
            tmp, fd = self._temp()
            os.close(fd)
            os.unlink(tmp)
            os.makedirs(os.path.dirname(real_new), exist_ok=True)
            try:
                os.link(real_old, tmp)  # same bytes without copying them
            except OSError:
                shutil.copyfile(real_old, tmp)
            os.rename(tmp, real_new)

        def _rename_dir(self, old, new, who):
            real_old, real_new = self._real(old), self._real(new)
            if self._local_files_under(old):  # gcsfuse: ENOTSUP while a file in it is not uploaded
                raise FuseOSError(errno.ENOTSUP)
            walked = list(os.walk(real_old))
            files = [os.path.join(d, f) for d, _, fs in walked for f in fs]
            objects = len(files) + sum(len(ds) for _, ds, _ in walked)  # a folder is an object too
            if objects > self.rename_dir_limit:
                self._record("non-atomic-rename", old, who, to=new.lstrip("/"), directory=True,
                             refused=f"EMFILE: {objects} objects > rename-dir-limit {self.rename_dir_limit}")
                raise FuseOSError(errno.EMFILE)
            if os.path.exists(real_new) and os.listdir(real_new):
                raise FuseOSError(errno.ENOTEMPTY)
            os.makedirs(real_new, exist_ok=True)
            total = 0
            for f in files:
                target = os.path.join(real_new, os.path.relpath(f, real_old))
                total += os.path.getsize(f)
                self._copy_object(f, target)
                os.unlink(f)
            shutil.rmtree(real_old, ignore_errors=True)
            self._record("non-atomic-rename", old, who, to=new.lstrip("/"), directory=True, bytes=total,
                         objects=len(files))

        def _truncate_writer(self, w: _Writer, length: int) -> None:
            """Cut or extend the file ``w`` writes to ``length`` bytes. Extending a file that
            streams (or is new) only sets its size (gcsfuse's streaming writer remembers it);
            cutting it, or changing an existing object, falls back to a staged write of the
            object's bytes."""
            size = os.fstat(w.fd).st_size if self._local(w) else (w.base[2] if w.base else 0)
            if length == size:
                return
            if w.finalized:  # uploaded by a close of another handle: a staged rewrite, uploaded at close
                self._private_copy(w)
                self._stage(w, "truncate", fetch=False)
                w.finalized = False
            else:
                extends = length > size and (w.mode == "stream" or w.mode is None and not w.opened_existing)
                if w.mode != "staged" and not extends:
                    self._stage(w, "truncate")  # the object's bytes first, then cut or extended
            os.ftruncate(w.fd, length)
            w.dirty = True
            w.next_offset = min(w.next_offset, length)  # a stream goes on where its bytes end

        def truncate(self, path, length, fh=None):
            with self._mu:
                w = self.handles.get(fh) if fh is not None else None
                if not isinstance(w, _Writer) and path is not None:
                    writers = self._mine(path, self._who())
                    w = writers[-1] if writers else None
                if isinstance(w, _Writer):
                    self._truncate_writer(w, length)
                    return 0
            if path is None:
                raise FuseOSError(errno.EBADF)
            real = self._real(path)
            current = _generation(real)
            if current is None:
                raise FuseOSError(errno.ENOENT)
            if current[2] == length:
                return 0
            who = self._who()
            if self.strict:
                self._record("staged", path, who, cause="truncate", bytes=0, refused="EIO (strict mode)")
                raise FuseOSError(errno.EIO)
            tmp, fd = self._temp()
            try:
                with open(real, "rb") as f:
                    keep = min(length, current[2])
                    os.sendfile(fd, f.fileno(), 0, keep) if keep else None
                os.ftruncate(fd, length)
            finally:
                os.close(fd)
            self._record("staged", path, who, cause="truncate", bytes=length)
            os.rename(tmp, real)
            with self._mu:
                self.last_write[path] = time.monotonic()
            return 0

        # --- files ----------------------------------------------------------------------
        def create(self, path, mode, fi=None):
            self._top(path)
            real = self._real(path)
            if not os.path.isdir(os.path.dirname(real)):
                raise FuseOSError(errno.ENOENT)
            temp, fd = self._temp()
            w = _Writer(path, fd, temp, _generation(real), self._who(), opened_existing=False)
            return self._add(w)

        def open(self, path, flags):
            real = self._real(path)
            who = self._who()
            if flags & os.O_ACCMODE == os.O_RDONLY:
                with self._mu:
                    local = [w for w in self._mine(path, who) if self._local(w)]
                    for w in local:  # reading a file still streaming: finalized, then staged
                        if w.mode in (None, "stream"):
                            self._read_while_writing(w)
                    writers = [w for w in self._mine(path, who) if self._local(w)]
                    if writers:  # a staged local copy is what this mount shows
                        fd = os.open(writers[-1].temp, os.O_RDONLY)
                        return self._add(_Reader(path, fd, who))
                try:
                    fd = os.open(real, os.O_RDONLY)
                except FileNotFoundError:
                    raise FuseOSError(errno.ENOENT) from None
                return self._add(_Reader(path, fd, who))
            with self._mu:
                # the task's file open for writing and not yet uploaded: one inode, one local copy.
                # One a close has uploaded is the object now: a new open of it is an open of that
                # object (the kernel's release of the closed handle comes later, asynchronously,
                # so the closed handle may still be here; joining it made the next write a
                # write-after-close instead of an overwrite, depending on that timing).
                mine = [w for w in self._open_of(path, who) if not w.finalized]
                if mine:
                    w = mine[-1]
                    if flags & os.O_TRUNC:
                        self._truncate_writer(w, 0)
                    w.refs += 1
                    return self._add(w)
                others = self._writers(path)
            if others and not os.path.exists(real):
                # another task's file not uploaded yet: a new file on this task's mount
                temp, fd = self._temp()
                return self._add(_Writer(path, fd, temp, None, who, opened_existing=False))
            if not os.path.exists(real):
                raise FuseOSError(errno.ENOENT)
            temp, fd = self._temp()
            w = _Writer(path, fd, temp, _generation(real), who, opened_existing=True)
            if flags & os.O_TRUNC and w.base is not None and w.base[2] > 0:
                # truncating an existing object on open: a staged rewrite of it from empty
                try:
                    self._stage(w, "truncate", fetch=False)
                except FuseOSError:
                    os.close(fd)
                    self._drop(w)
                    raise
                w.dirty = True
            return self._add(w)

        def _read_while_writing(self, w: _Writer) -> None:
            if self.strict:
                self._record("staged", w.path, w.who, cause="read-while-writing", bytes=0,
                             refused="EIO (strict mode)")
                raise FuseOSError(errno.EIO)
            if w.mode is None:
                w.mode = "stream"
            self._finalize(w, keep=True)
            w.mode, w.cause = "staged", "read-while-writing"

        def read(self, path, size, offset, fh):
            h = self.handles[fh]
            if isinstance(h, _Writer):
                with self._mu:
                    if not self._local(h):  # an existing object opened for writing, nothing written
                        try:
                            with open(self._real(h.path), "rb") as f:
                                data = os.pread(f.fileno(), size, offset)
                        except FileNotFoundError:
                            return b""
                        h.reads += len(data)  # read from the bucket, like a reading handle's
                        return data
                    if h.mode in (None, "stream") and not h.finalized:
                        self._read_while_writing(h)
                return os.pread(h.fd, size, offset)
            data = os.pread(h.fd, size, offset)
            h.bytes += len(data)
            return data

        def read_into(self, fh, buf, size, offset) -> int:
            h = self.handles[fh]
            if isinstance(h, _Writer):
                return self._read_copy(fh, buf, size, offset)
            got = os.preadv(h.fd, [buf], offset)
            h.bytes += got
            return got

        def _read_copy(self, fh, buf, size, offset) -> int:
            data = self.read(None, size, offset, fh)
            buf[:len(data)] = data
            return len(data)

        def write(self, path, data, offset, fh):
            w = self.handles[fh]
            if not isinstance(w, _Writer):
                raise FuseOSError(errno.EBADF)
            with self._mu:
                if w.finalized:  # uploaded by a close of one of its handles, or by a rename
                    self._private_copy(w)
                    if os.fstat(w.fd).st_size == 0:  # an empty object streams again (gcsfuse)
                        self._begin_stream(w, offset)
                    else:
                        self._stage(w, "write-after-rename" if w.cause == "write-after-rename"
                                    else "write-after-close", fetch=False)
                    w.finalized = False  # only now: a refused write (strict) leaves the file as it was
                elif w.mode is None:
                    if w.opened_existing and not (w.base is not None and w.base[2] == 0):
                        self._stage(w, "overwrite")
                    else:  # a new file, or an existing empty object (gcsfuse streams both)
                        self._begin_stream(w, offset)
                elif w.mode == "stream" and offset != w.next_offset:
                    self._stage(w, "out-of-order-write")
                w.dirty = True
            written = os.pwrite(w.fd, data, offset)
            if offset + written > w.next_offset:
                w.next_offset = offset + written
            return written

        def write_from(self, fh, buf, offset) -> int:
            return self.write(None, buf, offset, fh)

        def fsync(self, path, datasync, fh):
            h = self.handles.get(fh)
            if isinstance(h, _Writer) and h.mode == "staged" and h.dirty and not h.finalized:
                with self._mu:
                    self._finalize(h)  # staged: fsync uploads; streaming: fsync does not finalize
            return 0

        def flush(self, path, fh):
            h = self.handles.get(fh)
            if isinstance(h, _Reader):
                if h.bytes:  # counted at close (release comes later, asynchronously)
                    self._record("read", h.path, h.who, bytes=h.bytes)
                    h.bytes = 0
                return 0
            if isinstance(h, _Writer) and h.reads:  # what the handle downloaded (reads, a staged fetch)
                self._record("read", h.path, h.who, bytes=h.reads)
                h.reads = 0
            if not isinstance(h, _Writer) or h.finalized:
                return 0
            with self._mu:
                if h.unlinked:
                    h.finalized = True
                    return 0
                if h.mode is None and h.opened_existing:
                    h.finalized = True  # opened for write, nothing written: no upload
                    return 0
                if h.mode is None:
                    h.mode = "stream"
                if h.mode == "staged" and not h.dirty:
                    h.finalized = True
                    return 0
                mode = h.mode
                try:
                    self._finalize(h)
                finally:
                    h.finalized = True
                    h.mode = mode
            return 0

        def release(self, path, fh):
            with self._mu:
                h = self.handles.pop(fh, None)
            if h is None:
                return 0
            if isinstance(h, _Reader):
                if h.bytes:
                    self._record("read", h.path, h.who, bytes=h.bytes)
                os.close(h.fd)
                return 0
            with self._mu:
                h.refs -= 1
                if h.refs > 0:  # another handle of the task still has the file open
                    return 0
            os.close(h.fd)
            self._drop(h)
            return 0

    return GcsFuseOperations()


def _fast_fuse_class():
    """An ``mfusepy.FUSE`` whose read and write move bytes between the kernel's buffer and the
    files without a Python ``bytes`` copy per call, whose truncate gets the file handle, and
    which refuses ``renameat2`` flags (``EINVAL``) rather than ignore them."""
    import ctypes

    import mfusepy

    class FastFUSE(mfusepy.FUSE):
        def read(self, path, buf, size, offset, fip):
            fh = fip.contents.fh
            view = (ctypes.c_char * size).from_address(ctypes.cast(buf, ctypes.c_void_p).value)
            return self.operations.read_into(fh, memoryview(view).cast("B"), size, offset)

        def write(self, path, buf, size, offset, fip):
            fh = fip.contents.fh
            view = (ctypes.c_char * size).from_address(ctypes.cast(buf, ctypes.c_void_p).value)
            return self.operations.write_from(fh, memoryview(view).cast("B"), offset)

        def truncate_fuse_3(self, path, length, fip):
            # mfusepy drops the handle; ftruncate must cut the file of the handle it names
            fh = fip.contents.fh if fip else None
            return self.operations.truncate(None if path is None else path.decode(self.encoding, self.errors),
                                            length, fh)

        def rename_fuse_3(self, old, new, flags):
            # mfusepy drops renameat2's flags (an exchange became a plain rename, losing a file);
            # gcsfuse supports none of them
            if flags:
                return -errno.EINVAL
            return self.rename_fuse_2(old, new)

    return FastFUSE


def _watch_parent(mountpoint: str) -> None:
    """Unmount when the parent process dies (the emulator hard-killed), which ends the loop."""
    parent = os.getppid()
    while True:
        time.sleep(0.2)
        if os.getppid() != parent:
            subprocess.run(["fusermount3", "-u", "-z", mountpoint], check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
            os._exit(0)


def main(argv=None) -> int:
    """Mount process: ``--source DIR --mountpoint DIR --state-dir DIR [--strict] [--option K=V]...``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m airflow_gpu_resilience.emulator.gcsfuse")
    parser.add_argument("--source", required=True)
    parser.add_argument("--mountpoint", required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--buckets-root", action="store_true")
    parser.add_argument("--option", action="append", default=[])
    args = parser.parse_args(argv)
    options = parse_mount_options(args.option, "--option", emulator=True)
    os.makedirs(os.path.join(args.state_dir, "staging"), exist_ok=True)
    threading.Thread(target=_watch_parent, args=(args.mountpoint,), daemon=True).start()
    ops = _make_fs(args.source, args.state_dir, args.strict, options, args.buckets_root)
    try:
        _fast_fuse_class()(ops, args.mountpoint, foreground=True, fsname="gcsfuse-emulator",
                           allow_other=os.getuid() == 0)
    except RuntimeError as exc:  # libfuse's loop ends with a code after SIGTERM: a normal stop
        print(f"gcsfuse: loop ended ({exc})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
