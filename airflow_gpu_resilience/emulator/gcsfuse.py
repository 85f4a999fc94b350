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
  first), ``write-after-close``, ``streaming-limit`` (more than ``write-global-max-blocks``,
  default 4, files streaming at once) and ``streaming-disabled`` (``enable-streaming-writes=false``).
  A staged file is uploaded at ``close()`` and also at ``fsync``.
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
- **Two writers of one object**: each open-for-write is its own writer (as if on its own mount);
  the first close wins, and a writer whose object changed since it opened it gets ``ESTALE`` at
  close (recorded as ``estale``).
- **Reads** go to the bucket folder on every open (no cache kept across opens); bytes read per
  object are counted (``read`` records at each close of a reading handle, and
  :meth:`GcsFuseMount.stats` ``bytesRead``).

Every record in ``events.jsonl`` is one JSON object: ``kind`` (``staged``, ``throttled-rewrite``,
``non-atomic-rename``, ``estale``, ``read``), ``object``, ``time`` (epoch s), ``cause`` and
``bytes`` where they apply, and the writer's ``execution``, ``taskIndex`` and ``attempt`` (from its
``CLOUD_RUN_*`` environment) or ``pid``.

Accepted mount options (gcsfuse flags without ``--``, :data:`MOUNT_OPTIONS`): ``implicit-dirs``,
``only-dir``, ``file-mode``, ``dir-mode``, ``uid``, ``gid``, ``rename-dir-limit``,
``enable-streaming-writes``, ``write-global-max-blocks``, ``metadata-cache-ttl-secs``,
``stat-cache-max-size-mb``, ``type-cache-max-size-mb``, ``kernel-list-cache-ttl-secs``,
``max-conns-per-host``, ``log-severity``; only ``rename-dir-limit``, ``enable-streaming-writes``,
``write-global-max-blocks``, ``file-mode``, ``dir-mode``, ``uid`` and ``gid`` change what the
emulated mount does. Not emulated: ``only-dir``, caches and their TTLs, HNS buckets, symbolic
links, ``readOnly``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat as statmod
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

#: gcsfuse flags a volume may carry, name -> kind (``bool``, ``int``, ``octal``, ``str``).
MOUNT_OPTIONS = {
    "implicit-dirs": "bool", "only-dir": "str", "file-mode": "octal", "dir-mode": "octal",
    "uid": "int", "gid": "int", "rename-dir-limit": "int", "enable-streaming-writes": "bool",
    "write-global-max-blocks": "int", "metadata-cache-ttl-secs": "int", "stat-cache-max-size-mb": "int",
    "type-cache-max-size-mb": "int", "kernel-list-cache-ttl-secs": "int", "max-conns-per-host": "int",
    "log-severity": "str",
}
#: Emulator-only volume options (Cloud Run would refuse them).
EMULATOR_OPTIONS = {"x-emulator-strict": "bool"}
#: Files that may stream at once before writes fall back to staging (gcsfuse's low-spec default).
DEFAULT_STREAMING_FILES = 4
#: Seconds between two writes of one object name below which a rewrite counts as throttled.
REWRITE_INTERVAL_S = 1.0
EVENT_KINDS = ("staged", "throttled-rewrite", "non-atomic-rename", "estale", "read")


def parse_mount_options(options, field: str = "mountOptions", emulator: bool = True) -> dict:
    """Validate gcsfuse mount options (``name`` or ``name=value``, no leading ``--``).

    :param options: iterable of strings.
    :param field: the request field, for error messages.
    :param emulator: also accept :data:`EMULATOR_OPTIONS`.
    :returns: ``{name: value}`` with bools, ints and octal modes converted.
    :raises ValueError: naming ``field``, the option and the allowed names or value kind.
    """
    allowed = dict(MOUNT_OPTIONS, **(EMULATOR_OPTIONS if emulator else {}))
    parsed = {}
    for i, raw in enumerate(options or ()):
        name, has_value, value = str(raw).partition("=")
        name = name.strip()
        if name.startswith("-"):
            raise ValueError(f"{field}[{i}]: '{raw}': write gcsfuse flags without the leading '--'.")
        if name not in allowed:
            raise ValueError(f"{field}[{i}]: unknown mount option '{name}'; allowed: {', '.join(sorted(allowed))}.")
        kind = allowed[name]
        try:
            if kind == "bool":
                if has_value and value.lower() not in ("true", "false"):
                    raise ValueError
                parsed[name] = (value.lower() != "false") if has_value else True
            elif kind in ("int", "octal"):
                number = int(value, 8 if kind == "octal" else 10)
                if number < 0:
                    raise ValueError
                parsed[name] = number
            else:
                if not has_value or not value:
                    raise ValueError
                parsed[name] = value
        except ValueError:
            raise ValueError(f"{field}[{i}]: mount option '{name}' needs "
                             f"{'true or false' if kind == 'bool' else 'a non-negative ' + kind + ' value' if kind != 'str' else 'a value'}"
                             f" (got '{raw}').") from None
    return parsed


def fuse_available() -> tuple:
    """``(True, "")`` when a FUSE mount can work here, else ``(False, reason)``: not Linux, no
    ``/dev/fuse``, no ``fusermount3``, or ``mfusepy``/libfuse3 not importable."""
    if not sys.platform.startswith("linux"):
        return False, f"not Linux ({sys.platform})"
    if not os.path.exists("/dev/fuse"):
        return False, "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return False, "no fusermount3 (Debian package fuse3)"
    try:
        import mfusepy  # noqa: F401  (loads libfuse)
    except (ImportError, OSError, EnvironmentError) as exc:
        return False, f"mfusepy or libfuse3 missing ({exc})"
    return True, ""


def _mounted(path: str) -> bool:
    try:
        with open("/proc/self/mounts") as mounts:
            return any(line.split()[1] == path for line in mounts if len(line.split()) > 1)
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
    found = []
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                parts = line.split()
                if len(parts) > 2 and parts[2].startswith("fuse") and parts[1].startswith(prefix):
                    found.append(parts[1].replace("\\040", " "))
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
    "causes": {cause: n}}`` of a list of records."""
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
            out["bytesRead"][ev["object"]] = out["bytesRead"].get(ev["object"], 0) + int(ev.get("bytes") or 0)
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
    :raises ValueError: for a bad mount option (before anything is started).
    """

    def __init__(self, source, mountpoint, state_dir, strict: bool = False, options=(),
                 start_timeout: float = 15.0) -> None:
        self.options = list(options or ())
        parse_mount_options(self.options)
        self.source = Path(source).resolve()
        self.mountpoint = Path(mountpoint).resolve()
        self.state_dir = Path(state_dir).resolve()
        self.strict = strict
        self.start_timeout = start_timeout
        self.events_path = self.state_dir / "events.jsonl"
        self.log_path = self.state_dir / "mount.log"
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "GcsFuseMount":
        """Mount; returns when the mount answers.

        :raises RuntimeError: when the file system process ends or does not mount in time.
        """
        self.source.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "staging").mkdir(parents=True, exist_ok=True)
        lazy_unmount(self.mountpoint)
        argv = [sys.executable, "-m", "airflow_gpu_resilience.emulator.gcsfuse", "--source", str(self.source),
                "--mountpoint", str(self.mountpoint), "--state-dir", str(self.state_dir)]
        argv += ["--strict"] if self.strict else []
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
    """The emulator's ``cloud-storage`` volumes: one FUSE mount per (bucket, mount options) per
    emulator, made when the first attempt that mounts it starts and kept until the emulator stops.

    Why per emulator and not per execution: a mount costs a process start (about 0.3 s) that
    would be added to every attempt, and the semantics a worker must meet are per file handle
    (each open-for-write is its own writer, so two tasks sharing a mount still see "first close
    wins" and ``ESTALE``); reads keep no cache across opens, so a shared mount hides no download.
    Volumes with different mount options get different mounts.

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
        if not self.fuse:
            return source
        options = list(options or ())
        parse_mount_options(options)
        key = (bucket, tuple(sorted(options)))
        with self._mu:
            mount = self._mounts.get(key)
            if mount is not None and mount.proc is not None and mount.proc.poll() is None:
                return mount.mountpoint
            import hashlib

            digest = hashlib.sha256(json.dumps([bucket, sorted(options)]).encode()).hexdigest()[:10]
            base = self.root / f"{bucket}-{digest}"
            mount = GcsFuseMount(source, base / "mnt", base / "state", strict=self.strict, options=options)
            mount.start()
            self._mounts[key] = mount
            return mount.mountpoint

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
        """``{"type", "reason", "strict", "mounts": [...], "summary": summarize(all events)}``."""
        with self._mu:
            mounts = [{"bucket": k[0], "mountOptions": list(k[1]), "mountpoint": str(m.mountpoint)}
                      for k, m in self._mounts.items()]
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
    return f"gcsfuse {ev.get('kind')}: {ev.get('object')} {extra} ({who})".rstrip()


# --------------------------------------------------------------------------------------------
# The file system (runs in the mount process)
# --------------------------------------------------------------------------------------------

class _Writer:
    """One open-for-write handle: its own local copy of the file (a staging file)."""

    __slots__ = ("path", "fd", "temp", "base", "mode", "cause", "next_offset", "who", "finalized", "dirty",
                 "unlinked", "reads", "opened_existing")

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


def _make_fs(source: str, state_dir: str, strict: bool, options: dict):
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
            self.stream_limit = options.get("write-global-max-blocks", DEFAULT_STREAMING_FILES)
            self.rename_dir_limit = options.get("rename-dir-limit", 0)
            self.file_mode = options.get("file-mode", 0o644)
            self.dir_mode = options.get("dir-mode", 0o755)
            self.uid = options.get("uid", os.getuid())
            self.gid = options.get("gid", os.getgid())
            self._mu = threading.RLock()
            self.handles: dict = {}
            self.next_fh = 1
            self.last_write: dict = {}  # object name -> monotonic time of its last finalize
            self.counter = 0

        # --- helpers ---------------------------------------------------------------------
        def _real(self, path: str) -> str:
            return self.root + path

        def _who(self) -> dict:
            return _identity(mfusepy.fuse_get_context()[2])

        def _record(self, kind: str, obj: str, who: Optional[dict] = None, **fields) -> None:
            event = {"kind": kind, "object": obj.lstrip("/"), "time": round(time.time(), 6), **fields}
            event.update(who or {})
            self.events.write(json.dumps(event) + "\n")

        def _add(self, handle) -> int:
            with self._mu:
                fh = self.next_fh
                self.next_fh += 1
                self.handles[fh] = handle
                return fh

        def _writers(self, path: str) -> list:
            return [h for h in self.handles.values() if isinstance(h, _Writer) and h.path == path
                    and not h.finalized and not h.unlinked]

        def _temp(self) -> tuple:
            with self._mu:
                self.counter += 1
                name = os.path.join(self.staging, f"{os.getpid()}-{self.counter}")
            return name, os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)

        def _streaming_now(self) -> int:
            return sum(1 for h in self.handles.values() if isinstance(h, _Writer) and h.mode == "stream"
                       and not h.finalized)

        def _stage(self, w: _Writer, cause: str) -> None:
            """Fall back to a staged write for ``w`` (or EIO in strict mode)."""
            if self.strict:
                self._record("staged", w.path, w.who, cause=cause, bytes=0, refused="EIO (strict mode)")
                raise FuseOSError(errno.EIO)
            if w.opened_existing and not w.dirty and w.mode is None and cause != "truncate":
                # the local copy of an existing object: the whole object is fetched first
                src = _generation(self._real(w.path))
                if src is not None:
                    with open(self._real(w.path), "rb") as f:
                        os.ftruncate(w.fd, 0)
                        os.sendfile(w.fd, f.fileno(), 0, src[2]) if src[2] else None
            w.mode, w.cause = "staged", cause

        def _finalize(self, w: _Writer) -> None:
            """Upload ``w``'s local copy as the object (a rename into the bucket folder)."""
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
            if w.mode == "staged" and not w.finalized:
                # a staged file may be written on after fsync: publish a copy, keep the local one
                tmp, fd = self._temp()
                try:
                    os.sendfile(fd, w.fd, 0, size) if size else None
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

        def getattr(self, path, fh=None):
            with self._mu:
                writers = self._writers(path)
                if writers:
                    st = os.fstat(writers[-1].fd)
                    return self._attrs(st)
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
                for h in self.handles.values():
                    if isinstance(h, _Writer) and not h.finalized and not h.unlinked and h.path.startswith(prefix):
                        rest = h.path[len(prefix):]
                        if "/" not in rest and rest not in names:
                            names.append(rest)
            return [".", ".."] + names

        def statfs(self, path):
            sv = os.statvfs(self.root)
            return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                               "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

        def mkdir(self, path, mode):
            try:
                os.mkdir(self._real(path))
            except FileExistsError:
                raise FuseOSError(errno.EEXIST) from None
            except FileNotFoundError:
                raise FuseOSError(errno.ENOENT) from None

        def rmdir(self, path):
            try:
                os.rmdir(self._real(path))
            except OSError as exc:
                raise FuseOSError(exc.errno) from None

        def unlink(self, path):
            with self._mu:
                pending = self._writers(path)
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
            try:
                os.utime(self._real(path), ns=times) if times else os.utime(self._real(path))
            except FileNotFoundError:
                pass
            return 0

        def rename(self, old, new):
            real_old, real_new = self._real(old), self._real(new)
            who = self._who()
            with self._mu:
                for w in self._writers(old):  # a file still being written is finalized first
                    self._finalize(w)
                    w.finalized = False
                    w.mode, w.cause = "staged", "write-after-rename"
                    w.path = new
                    w.base = None
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
                self.last_write[new] = time.monotonic()
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
            files = [os.path.join(d, f) for d, _, fs in os.walk(real_old) for f in fs]
            if len(files) > self.rename_dir_limit:
                self._record("non-atomic-rename", old, who, to=new.lstrip("/"), directory=True,
                             refused=f"EMFILE: {len(files)} objects > rename-dir-limit {self.rename_dir_limit}")
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

        def truncate(self, path, length, fh=None):
            with self._mu:
                w = self.handles.get(fh) if fh else None
                if not isinstance(w, _Writer):
                    writers = self._writers(path)
                    w = writers[-1] if writers else None
                if w is not None:
                    size = os.fstat(w.fd).st_size
                    if length == size:
                        return 0
                    if w.mode == "stream" or (w.mode is None and length < size) or w.opened_existing:
                        if w.mode != "staged":
                            self._stage(w, "truncate")
                    os.ftruncate(w.fd, length)
                    w.dirty = True
                    w.next_offset = length
                    return 0
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
            real = self._real(path)
            if not os.path.isdir(os.path.dirname(real)):
                raise FuseOSError(errno.ENOENT)
            temp, fd = self._temp()
            w = _Writer(path, fd, temp, _generation(real), self._who(), opened_existing=False)
            return self._add(w)

        def open(self, path, flags):
            real = self._real(path)
            if flags & os.O_ACCMODE == os.O_RDONLY:
                with self._mu:
                    streaming = [w for w in self._writers(path) if w.mode == "stream" or w.mode is None]
                    for w in streaming:  # reading a file still streaming: finalized, then staged
                        self._read_while_writing(w)
                    writers = self._writers(path)
                    if writers:  # a staged local copy is what this mount shows
                        fd = os.open(writers[-1].temp, os.O_RDONLY)
                        return self._add(_Reader(path, fd, self._who()))
                try:
                    fd = os.open(real, os.O_RDONLY)
                except FileNotFoundError:
                    raise FuseOSError(errno.ENOENT) from None
                return self._add(_Reader(path, fd, self._who()))
            with self._mu:
                mine = [w for w in self._writers(path)]
            if mine and not os.path.exists(real):
                # reopening a file that is still a local file: a new writer on the same new file
                temp, fd = self._temp()
                w = _Writer(path, fd, temp, None, self._who(), opened_existing=False)
                w.mode, w.cause = None, None
                return self._add(w)
            if not os.path.exists(real):
                raise FuseOSError(errno.ENOENT)
            temp, fd = self._temp()
            w = _Writer(path, fd, temp, _generation(real), self._who(), opened_existing=True)
            if flags & os.O_TRUNC and w.base is not None and w.base[2] > 0:
                # truncating an existing object on open: a staged rewrite of it from empty
                try:
                    self._stage(w, "truncate")
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
            self._finalize_keep(w)
            w.mode, w.cause = "staged", "read-while-writing"

        def _finalize_keep(self, w: _Writer) -> None:
            """Finalize the object now but keep writing to the local copy (read/rename while writing)."""
            real = self._real(w.path)
            size = os.fstat(w.fd).st_size
            tmp, fd = self._temp()
            try:
                os.sendfile(fd, w.fd, 0, size) if size else None
            finally:
                os.close(fd)
            os.makedirs(os.path.dirname(real), exist_ok=True)
            os.rename(tmp, real)
            self.last_write[w.path] = time.monotonic()
            w.base = _generation(real)

        def read(self, path, size, offset, fh):
            h = self.handles[fh]
            if isinstance(h, _Writer):
                with self._mu:
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
                if w.finalized:
                    w.finalized = False
                    w.mode, w.cause = None, None
                    self._stage(w, "write-after-close")
                    # the local copy was published by the close; write on a fresh copy
                    if w.temp is None:
                        temp, fd = self._temp()
                        size = os.fstat(w.fd).st_size
                        os.sendfile(fd, w.fd, 0, size) if size else None
                        os.close(w.fd)
                        w.fd, w.temp = fd, temp
                elif w.mode is None:
                    if w.opened_existing:
                        self._stage(w, "overwrite")
                    elif not self.streaming:
                        self._stage(w, "streaming-disabled")
                    elif self._streaming_now() >= self.stream_limit:
                        self._stage(w, "streaming-limit")
                    elif offset != 0:
                        self._stage(w, "out-of-order-write")
                    else:
                        w.mode = "stream"
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
            os.close(h.fd)
            self._drop(h)
            return 0

    return GcsFuseOperations()


def _fast_fuse_class():
    """An ``mfusepy.FUSE`` whose read and write move bytes between the kernel's buffer and the
    files without a Python ``bytes`` copy per call."""
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
    parser.add_argument("--option", action="append", default=[])
    args = parser.parse_args(argv)
    options = parse_mount_options(args.option)
    os.makedirs(os.path.join(args.state_dir, "staging"), exist_ok=True)
    threading.Thread(target=_watch_parent, args=(args.mountpoint,), daemon=True).start()
    ops = _make_fs(args.source, args.state_dir, args.strict, options)
    try:
        _fast_fuse_class()(ops, args.mountpoint, foreground=True, fsname="gcsfuse-emulator",
                           allow_other=os.getuid() == 0)
    except RuntimeError as exc:  # libfuse's loop ends with a code after SIGTERM: a normal stop
        print(f"gcsfuse: loop ended ({exc})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
