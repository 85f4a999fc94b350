"""In-process GCS emulator (``gcp-storage-emulator``) and the bridge to GCS volume mounts.

Objects live as plain files under ``{data_dir}/gcs/.cloudstorage/{bucket}/{object}`` with a
``.meta`` JSON index, so a task that writes through its "mount" (the bucket directory) writes
real object bytes. :meth:`GcsService.reconcile` brings the index in line with the files (new,
changed and removed objects) so those writes become visible through the Storage API. Requests
to the storage server and reconciliation are serialized by one lock.

Not emulated: GCS FUSE semantics (implicit directories, ``readOnly``, ``mountOptions``,
non-atomic rename); object writes become visible at reconciliation, not at ``close()``.
"""

from __future__ import annotations

import hashlib
import threading
from base64 import b64encode
from functools import partial
from http.server import HTTPServer
from pathlib import Path

from gcp_storage_emulator.handlers import objects as gcs_objects
from gcp_storage_emulator.server import RequestHandler
from gcp_storage_emulator.settings import STORAGE_DIR
from gcp_storage_emulator.storage import Storage



def bucket_path(data_dir, bucket: str) -> Path:
    """Local directory of ``bucket`` for an emulator whose data directory is ``data_dir``."""
    return Path(data_dir).resolve() / "gcs" / STORAGE_DIR / bucket


class _LockedHandler(RequestHandler):
    """Storage request handler that holds the service lock for the whole request."""

    def __init__(self, lock, storage, *args, **kwargs):
        self._service_lock = lock
        super().__init__(storage, *args, **kwargs)

    def handle_one_request(self):
        with self._service_lock:
            super().handle_one_request()


class GcsService:
    """The storage server plus mount reconciliation.

    :param data_dir: emulator data directory; storage goes under ``data_dir / "gcs"``.
    :param port: TCP port on 127.0.0.1 (0 picks a free one; see :attr:`port`).
    """

    def __init__(self, data_dir: Path, port: int) -> None:
        self.lock = threading.RLock()
        self.storage = Storage(data_dir=str(Path(data_dir, "gcs").resolve()))
        self.root = Path(self.storage.get_storage_base(), STORAGE_DIR)
        self._httpd = HTTPServer(("127.0.0.1", port), partial(_LockedHandler, self.lock, self.storage))
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
        key = (stat.st_size, stat.st_mtime_ns)
        if self._seen.get((bucket, name)) == key:
            return False
        content = path.read_bytes()
        md5 = b64encode(hashlib.md5(content).digest()).decode("ascii")
        self._seen[(bucket, name)] = key
        if name in index and index[name].get("md5Hash") == md5:
            return False
        obj = gcs_objects._make_object_resource(
            self.endpoint, bucket, name, "application/octet-stream", stat.st_size)
        index[name] = gcs_objects._checksums(content, obj)
        return True
