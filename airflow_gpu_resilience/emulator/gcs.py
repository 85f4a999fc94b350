"""In-process GCS emulator (``gcp-storage-emulator``) and the bridge to GCS volume mounts.

Objects live as plain files under ``{data_dir}/gcs/.cloudstorage/{bucket}/{object}`` with a
``.meta`` JSON index, so a task that writes through its "mount" (the bucket directory) writes
real object bytes. :meth:`GcsService.reconcile` brings the index in line with the files (new,
changed and removed objects; unchanged files cost one ``stat``). It runs before every Storage
API request and after every task attempt, under one lock, so writes through a mount are
visible through the Storage API at once, with correct hashes.

Not emulated: GCS FUSE semantics (implicit directories, ``readOnly``, ``mountOptions``,
non-atomic rename, visibility only at ``close()``): a file still being written is visible as
it is at the moment of the request.
"""

from __future__ import annotations

import hashlib
import threading
import time
from base64 import b64encode
from functools import partial
from http.server import HTTPServer
from pathlib import Path

from gcp_storage_emulator.handlers import objects as gcs_objects
from gcp_storage_emulator.server import RequestHandler
from gcp_storage_emulator.settings import STORAGE_DIR
from gcp_storage_emulator.storage import Storage

_MTIME_SLACK_NS = 50_000_000


def bucket_path(data_dir, bucket: str) -> Path:
    """Local directory of ``bucket`` for an emulator whose data directory is ``data_dir``."""
    return Path(data_dir).resolve() / "gcs" / STORAGE_DIR / bucket


class _SyncedHandler(RequestHandler):
    """Storage request handler that, under the service lock, first re-indexes the buckets
    from disk, so a Storage API request always sees what tasks wrote through their mounts."""

    def __init__(self, service, *args, **kwargs):
        self._service = service
        super().__init__(service.storage, *args, **kwargs)

    def _synced(self, handle) -> None:
        with self._service.lock:
            self._service.reconcile(list(self._service.storage.buckets))
            handle()

    def do_GET(self):
        self._synced(super().do_GET)

    def do_POST(self):
        self._synced(super().do_POST)

    def do_PUT(self):
        self._synced(super().do_PUT)

    def do_PATCH(self):
        self._synced(super().do_PATCH)

    def do_DELETE(self):
        self._synced(super().do_DELETE)


class GcsService:
    """The storage server plus mount reconciliation.

    :param data_dir: emulator data directory; storage goes under ``data_dir / "gcs"``.
    :param port: TCP port on 127.0.0.1 (0 picks a free one; see :attr:`port`).
    """

    def __init__(self, data_dir: Path, port: int) -> None:
        self.lock = threading.RLock()
        self.storage = Storage(data_dir=str(Path(data_dir, "gcs").resolve()))
        self.root = Path(self.storage.get_storage_base(), STORAGE_DIR)
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
            return self.storage.get_bucket(bucket) is not None

    def bucket_dir(self, bucket: str) -> Path:
        """Local directory backing ``bucket`` (the mount source)."""
        return self.root / bucket

    def wipe(self) -> None:
        """Delete every bucket and object."""
        with self.lock:
            self.storage.wipe()
            self._seen.clear()

    def reconcile(self, buckets) -> None:
        """Index files written through mounts of ``buckets``; drop entries whose file is gone."""
        with self.lock:
            for bucket in buckets:
                if self.storage.get_bucket(bucket) is not None and self._reconcile_bucket(bucket):
                    self.storage._write_config_to_file()

    def _reconcile_bucket(self, bucket: str) -> bool:
        root = self.bucket_dir(bucket)
        on_disk = {p.relative_to(root).as_posix(): p for p in root.rglob("*") if p.is_file()}
        index = self.storage.objects.setdefault(bucket, {})
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
        obj = gcs_objects._make_object_resource(
            self.endpoint, bucket, name, "application/octet-stream", stat.st_size)
        index[name] = gcs_objects._checksums(content, obj)
        return True
