"""In-process GCS emulator (``gcp-storage-emulator``) and the bridge to GCS volume mounts.

Objects live as plain files under ``{data_dir}/gcs/.cloudstorage/{bucket}/{object}`` with a
``.meta`` JSON index, so a task that writes through its "mount" (the bucket directory) writes
real object bytes. :meth:`GcsService.reconcile` brings the index in line with the files (new,
changed and removed objects; unchanged files cost one ``stat``). It runs before every Storage
API request and after every task attempt, under one lock, so writes through a mount are
visible through the Storage API at once, with correct hashes.

Requests pass the checks of :mod:`.guards` first (loopback ``Host``, no foreign ``Origin``, no
form-typed POST, no ``GET /wipe``), and a bucket insert needs a name valid under Cloud Storage's
rules, so no bucket folder is made outside the storage root. Linked files in a bucket folder are
not indexed.

Tasks reach a bucket folder through a FUSE mount with Cloud Storage FUSE semantics where FUSE
works (:mod:`.gcsfuse`: an object lands in the folder only at ``close()``); with plain folders (no
FUSE) a file still being written is visible as it is at the moment of the request.
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time
from base64 import b64encode
from functools import partial
from http.server import HTTPServer
from pathlib import Path
from urllib.parse import urlparse

from gcp_storage_emulator.handlers import objects as gcs_objects
from gcp_storage_emulator.server import RequestHandler
from gcp_storage_emulator.settings import STORAGE_DIR
from gcp_storage_emulator.storage import Storage as _EmulatorStorage

from .exceptions import InvalidArgument, PayloadTooLarge, PermissionDenied
from .guards import PathEscape, contained, header_lists, refusal
from .validation import validate_bucket_name

_MTIME_SLACK_NS = 50_000_000
#: Largest bucket insert body read (bytes): a bucket resource is a few hundred bytes.
_MAX_BUCKET_INSERT_BYTES = 1024 * 1024


def bucket_path(data_dir, bucket: str) -> Path:
    """Local directory of ``bucket`` for an emulator whose data directory is ``data_dir``."""
    return contained(Path(data_dir).resolve() / "gcs" / STORAGE_DIR, bucket)


class StorageAdapter:
    """The one place that reaches into ``gcp-storage-emulator`` beyond its request handler: its
    storage object's index (``buckets``, ``objects``), its private ``_write_config_to_file`` and
    the private object-resource helpers of its ``objects`` handlers. A new release of that package
    that renames them breaks this class only.

    :param data_dir: the folder the storage keeps its ``.cloudstorage`` tree and index in.
    """

    def __init__(self, data_dir: Path) -> None:
        self.backend = _EmulatorStorage(data_dir=str(Path(data_dir).resolve()))
        #: the folder holding one sub-folder per bucket
        self.root = Path(self.backend.get_storage_base(), STORAGE_DIR)
        self._contain_writes()

    def _contain_writes(self) -> None:
        """Make every file the storage writes (uploads, copies, resumable parts, its index) stay
        inside its folder with symbolic links resolved: a task may leave a link in a mounted
        bucket, and an upload through it would otherwise write wherever the link points.

        :raises PathEscape: from a write whose resolved path leaves the storage folder.
        """
        store = self.backend._store
        write_bytes = store.write_bytes

        def contained_write(rel: str, content: bytes) -> None:  # rel: relative to self.root
            contained(self.root, *[part for part in str(rel).replace("\\", "/").split("/") if part])
            write_bytes(rel, content)

        store.write_bytes = contained_write

    def bucket_names(self) -> list:
        """Names of the buckets that exist."""
        return list(self.backend.buckets)

    def has_bucket(self, bucket: str) -> bool:
        return self.backend.get_bucket(bucket) is not None

    def wipe(self) -> None:
        """Delete every bucket and object."""
        self.backend.wipe()

    def object_index(self, bucket: str) -> dict:
        """The live ``{object name: object resource}`` index of ``bucket`` (changes go to disk
        with :meth:`save_index`)."""
        return self.backend.objects.setdefault(bucket, {})

    def save_index(self) -> None:
        """Write the index (``.meta``) to disk."""
        self.backend._write_config_to_file()

    def object_resource(self, endpoint: str, bucket: str, name: str, content: bytes, size: int) -> dict:
        """The object resource the storage keeps for ``content`` (hashes included), typed
        ``application/octet-stream``.

        :param size: the object's size in bytes, as reported (the file's size when it was stat'ed).
        """
        obj = gcs_objects._make_object_resource(endpoint, bucket, name, "application/octet-stream", size)
        return gcs_objects._checksums(content, obj)


#: Paths of the Storage API's bucket insert (``POST``), with and without ``/storage/v1``.
_BUCKET_INSERT = ("/storage/v1/b", "/b")


class _Replayed:
    """A request stream whose first bytes were already read: they are served again first."""

    def __init__(self, head: bytes, stream) -> None:
        self._head = io.BytesIO(head)
        self._stream = stream

    def read(self, size: int = -1) -> bytes:
        data = self._head.read(size)
        if size is None or size < 0:
            return data + self._stream.read()
        return data + (self._stream.read(size - len(data)) if len(data) < size else b"")

    def readline(self, size: int = -1) -> bytes:
        line = self._head.readline(size)
        if line.endswith(b"\n") or (size is not None and 0 <= size <= len(line)):
            return line
        return line + self._stream.readline(-1 if size is None or size < 0 else size - len(line))

    def close(self) -> None:
        self._stream.close()


class _SyncedHandler(RequestHandler):
    """Storage request handler that first applies the emulator's checks (see :mod:`.guards`; a
    bucket insert also needs a valid bucket name), then, under the service lock, re-indexes the
    buckets from disk, so a Storage API request always sees what tasks wrote through their mounts."""

    def __init__(self, service, *args, **kwargs):
        self._service = service
        super().__init__(service.storage.backend, *args, **kwargs)

    def _synced(self, method: str, handle) -> None:
        problem = self._refusal(self.headers.get("x-http-method-override") or method)
        if problem is not None:
            self._send_error(problem)
            return
        with self._service.lock:
            self._service.reconcile(self._service.storage.bucket_names())
            try:
                handle()
            except PathEscape as exc:
                self._send_error(PermissionDenied(f"name: the object's path leaves its bucket ({exc})."))
            except ValueError as exc:  # the storage refuses '..' in object paths, before answering
                if "invalid path" not in str(exc):
                    raise
                self._send_error(InvalidArgument(f"name: invalid object name ({exc})."))

    def _refusal(self, method: str):
        problem = refusal(method, header_lists(self.headers.items()), json_only=False)
        if problem is not None:
            return problem
        # the path exactly as the storage's router matches it (``;params`` dropped, not decoded)
        path = urlparse(f"http://host{self.path}").path
        if path.rstrip("/") == "/wipe":
            return PermissionDenied("GET /wipe of the GCS emulator is disabled (use POST /_emulator/reset).")
        if method == "POST" and path.rstrip("/") in _BUCKET_INSERT:
            return self._bucket_name_problem()
        return None

    def _bucket_name_problem(self):
        """Read the bucket insert body (it is served again to the handler) and check its name."""
        try:
            length = int(self.headers.get("Content-Length") or "")
        except ValueError:
            return InvalidArgument("Content-Length: a bucket insert needs a Content-Length.")
        if length > _MAX_BUCKET_INSERT_BYTES:
            return PayloadTooLarge(f"Request payload size exceeds the limit: {_MAX_BUCKET_INSERT_BYTES} bytes.")
        body = self.rfile.read(length)
        self.rfile = _Replayed(body, self.rfile)
        try:
            resource = json.loads(body or b"{}")
        except (ValueError, RecursionError):
            return InvalidArgument("Invalid JSON payload in the bucket insert.")
        if not isinstance(resource, dict):
            return InvalidArgument("Invalid JSON payload in the bucket insert: expected an object.")
        try:
            validate_bucket_name(resource.get("name"), "name")
        except InvalidArgument as err:
            return err
        return None

    def _send_error(self, error) -> None:
        body = json.dumps(error.to_dict()).encode()
        self.close_connection = True
        self.send_response(error.http_code)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._synced("GET", super().do_GET)

    def do_POST(self):
        self._synced("POST", super().do_POST)

    def do_PUT(self):
        self._synced("PUT", super().do_PUT)

    def do_PATCH(self):
        self._synced("PATCH", super().do_PATCH)

    def do_DELETE(self):
        self._synced("DELETE", super().do_DELETE)


class GcsService:
    """The storage server plus mount reconciliation.

    ``storage`` is the :class:`StorageAdapter`; ``root`` its folder of bucket folders.

    :param data_dir: emulator data directory; storage goes under ``data_dir / "gcs"``.
    :param port: TCP port on 127.0.0.1 (0 picks a free one; see ``port``).
    """

    def __init__(self, data_dir: Path, port: int) -> None:
        self.lock = threading.RLock()
        self.storage = StorageAdapter(Path(data_dir, "gcs"))
        self.root = self.storage.root
        self._httpd = HTTPServer(("127.0.0.1", port), partial(_SyncedHandler, self))
        self.port = self._httpd.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._seen: dict = {}
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="gcs", daemon=True)

    def start(self) -> None:
        """Serve in a daemon thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._httpd.shutdown()
        self._httpd.server_close()

    def bucket_exists(self, bucket: str) -> bool:
        with self.lock:
            return self.storage.has_bucket(bucket)

    def bucket_dir(self, bucket: str) -> Path:
        """Local directory backing ``bucket`` (the mount source).

        :raises PathEscape: when ``bucket`` would name a folder outside the storage root.
        """
        return contained(self.root, bucket)

    def wipe(self) -> None:
        """Delete every bucket and object."""
        with self.lock:
            self.storage.wipe()
            self._seen.clear()

    def reconcile(self, buckets) -> None:
        """Index files written through mounts of ``buckets``; drop entries whose file is gone."""
        with self.lock:
            for bucket in buckets:
                try:
                    if self.storage.has_bucket(bucket) and self._reconcile_bucket(bucket):
                        self.storage.save_index()
                except PathEscape:  # a name no insert should have let in: never index through it
                    continue

    def _reconcile_bucket(self, bucket: str) -> bool:
        root = self.bucket_dir(bucket)
        # rglob does not descend into linked folders; linked files are skipped (they may point
        # out of the data folder, and the Storage API would serve what they point at)
        on_disk = {p.relative_to(root).as_posix(): p for p in root.rglob("*") if p.is_file() and not p.is_symlink()}
        index = self.storage.object_index(bucket)
        changed = False
        for name in [n for n in index if n not in on_disk]:
            del index[name]
            self._seen.pop((bucket, name), None)
            changed = True
        for name, path in on_disk.items():
            changed |= self._reconcile_file(bucket, name, path, index)
        return changed

    def _reconcile_file(self, bucket: str, name: str, path: Path, index: dict) -> bool:
        stat = path.stat()
        key = (stat.st_size, stat.st_mtime_ns, stat.st_ino)
        seen = self._seen.get((bucket, name))
        # mtime ticks are coarse (a few ms): trust an unchanged key only for a file last
        # modified well before it was last hashed
        if seen and seen[0] == key and stat.st_mtime_ns < seen[1] - _MTIME_SLACK_NS:
            return False
        checked_at = time.time_ns()
        content = path.read_bytes()
        md5 = b64encode(hashlib.md5(content).digest()).decode("ascii")
        self._seen[(bucket, name)] = (key, checked_at)
        if name in index and index[name].get("md5Hash") == md5:
            return False
        index[name] = self.storage.object_resource(self.endpoint, bucket, name, content, stat.st_size)
        return True
