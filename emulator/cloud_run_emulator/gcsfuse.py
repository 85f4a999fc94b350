"""Cloud Storage FUSE semantics for the emulator's ``cloud-storage`` volumes (libfuse3, ``mfusepy``).

On Cloud Run a GCS volume is a bucket mounted through Cloud Storage FUSE (gcsfuse), which is not
POSIX. This module mounts a bucket's folder of the GCS emulator (``gcp-storage-emulator`` keeps
each object as a plain file under ``{data_dir}/gcs/.cloudstorage/{bucket}/``) through a FUSE file
system that behaves the way gcsfuse 3 documents it, so an object appears in that folder (and so
through the Storage API) only when gcsfuse would have created it.

Mount API (stable; the worker's fault suite uses it directly)::

    from cloud_run_emulator.gcsfuse import GcsFuseMount, fuse_available

    ok, why = fuse_available()             # (False, "no /dev/fuse") where FUSE cannot work
    with GcsFuseMount(source=bucket_dir, mountpoint=mnt, state_dir=state,
                      strict=False, options=["rename-dir-limit=10"]) as mount:
        ...                                # write and read under ``mnt``
        mount.events()                     # [{"kind": "staged", "cause": "overwrite", ...}, ...]
        mount.stats()                      # {"staged": 1, "throttled": 0, ..., "bytesRead": {obj: n}}

``source`` is the folder holding the objects (a bucket folder), ``mountpoint`` an empty folder,
``state_dir`` a folder on the same file system as ``source`` (staging files, ``events.jsonl``).
The file system runs in its own process (``python -m cloud_run_emulator.gcsfuse_process``),
which unmounts itself when it gets SIGTERM or when its parent process dies (even by SIGKILL);
:meth:`GcsFuseMount.stop` and :func:`unmount_stale` lazily unmount (``fusermount3 -u -z``).

Modules: this one is what the emulator imports (the mounts, their records); it and
:mod:`.gcsfuse_host` (FUSE available?, the mount table, unmounts) and :mod:`.gcsfuse_events` (the
records) import no FUSE library. Only the mount process imports ``mfusepy`` and the file system:
:mod:`.gcsfuse_process` (its main), :mod:`.gcsfuse_ops` and :mod:`.gcsfuse_namespace` (the FUSE
operations), :mod:`.gcsfuse_writes` (streaming or staged, uploads), :mod:`.gcsfuse_handles` (open
files, local copies) and :mod:`.gcsfuse_store` (the bucket folder); the rules they follow are the
pure functions of :mod:`.gcsfuse_rules`.

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
:func:`cloud_run_emulator.mount_options.parse_mount_options`, the job spec's rules):
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

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from cloud_run_emulator.mount_options import mount_key, parse_mount_options

from .gcsfuse_events import EVENT_KINDS, event_line, read_events, summarize
from .gcsfuse_host import fuse_available, is_mounted, lazy_unmount, unmount_stale

__all__ = ["EVENT_KINDS", "GcsFuseMount", "VolumeMounts", "event_line", "fuse_available", "lazy_unmount",
           "read_events", "summarize", "unmount_stale"]


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
        argv = [sys.executable, "-m", "cloud_run_emulator.gcsfuse_process", "--source", str(self.source),
                "--mountpoint", str(self.mountpoint), "--state-dir", str(self.state_dir)]
        argv += ["--strict"] if self.strict else []
        argv += ["--buckets-root"] if self.buckets_root else []
        for option in self.options:
            argv += ["--option", option]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while not is_mounted(str(self.mountpoint)):
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
