"""Fast paths for big checkpoints: reused host buffers, and sha256 overlapped with file I/O.

``hashlib`` and file reads/writes release the GIL on large buffers, so hashing one chunk on a
helper thread while the calling thread writes (or reads) it costs ``max(hash, io)`` instead of
their sum.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

#: Chunk size of overlapped hashing and I/O, in bytes (8 MiB).
CHUNK = 8 << 20
#: Writes shorter than this are buffered and hashed inline, in bytes (1 MiB).
SMALL_WRITE = 1 << 20

_POOL_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    """:return: the one helper thread that hashes while the caller does I/O."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256")
        return _POOL


def _write_all(handle: BinaryIO, view: memoryview) -> None:
    """Write all of ``view`` (a raw file may write less than asked)."""
    while view.nbytes:
        written = handle.write(view)
        view = view[written if written is not None else view.nbytes:]


class HashingWriter:
    """A write-only file object that hashes (sha256) and counts what goes through it.

    Give it to ``torch.save``: big tensor records are written in :data:`CHUNK` pieces, each
    hashed on the helper thread while it is written; small records are collected in a buffer.

    :param handle: an unbuffered binary file opened for writing.
    """

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._digest = hashlib.sha256()
        self._small = bytearray()
        self.size = 0

    def write(self, data: Any) -> int:
        """Hash and write ``data`` (any buffer). :return: the number of bytes taken."""
        view = memoryview(data).cast("B")
        if view.nbytes < SMALL_WRITE:
            self._small += view
            if len(self._small) >= CHUNK:
                self._drain()
        else:
            self._drain()
            self._overlapped(view)
        self.size += view.nbytes
        return view.nbytes

    def _overlapped(self, view: memoryview) -> None:
        """Write ``view`` chunk by chunk while the helper thread hashes them in order; the
        hasher always has the next chunk queued, and all of them are hashed before returning
        (``view`` is only guaranteed valid during this call)."""
        pool, pending = _pool(), []
        try:
            for offset in range(0, view.nbytes, CHUNK):
                chunk = view[offset : offset + CHUNK]
                pending.append(pool.submit(self._digest.update, chunk))
                _write_all(self._handle, chunk)
                if len(pending) > 2:
                    pending.pop(0).result()
        finally:
            for hashed in pending:
                hashed.result()

    def _drain(self) -> None:
        if self._small:
            self._digest.update(self._small)
            _write_all(self._handle, memoryview(self._small))
            self._small = bytearray()

    def flush(self) -> None:
        """Write out buffered small records."""
        self._drain()

    def hexdigest(self) -> str:
        """:return: the sha256 of everything written, after flushing."""
        self._drain()
        return self._digest.hexdigest()


def hash_stream(handle: BinaryIO) -> tuple[int, str]:
    """Read ``handle`` to its end, hashing chunk ``i`` while chunk ``i + 1`` is read.

    :param handle: an unbuffered binary file opened for reading.
    :return: ``(size in bytes, sha256 hex digest)``.
    :raises OSError: when reading fails.
    """
    digest, pool, size = hashlib.sha256(), _pool(), 0
    buffers = (memoryview(bytearray(CHUNK)), memoryview(bytearray(CHUNK)))
    pending = None
    index = 0
    while True:
        buffer = buffers[index % 2]
        count = handle.readinto(buffer) or 0
        if pending is not None:
            pending.result()  # the other buffer is free again
        if count == 0:
            return size, digest.hexdigest()
        size += count
        pending = pool.submit(digest.update, buffer[:count])
        index += 1


def hash_file(path: str) -> tuple[int, str]:
    """sha256 of a local file through a read-only memory map: no copy into user buffers, and
    the pages stay cached for a memory-mapped ``torch.load`` right after.

    :param path: a local (or FUSE-mounted) file.
    :return: ``(size in bytes, sha256 hex digest)``.
    :raises OSError: when the file cannot be opened or mapped.
    """
    import mmap

    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            return 0, digest.hexdigest()
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            if hasattr(mapped, "madvise"):
                mapped.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mapped)
            try:
                for offset in range(0, size, CHUNK):
                    digest.update(view[offset : offset + CHUNK])
            finally:
                view.release()
    return size, digest.hexdigest()


class SnapshotBuffers:
    """Host copies of nested state, into buffers kept from one save to the next.

    The first snapshot allocates (pinned memory when the source is on CUDA); later ones with the
    same structure copy into the same buffers, so no page is faulted in again. A snapshot's
    buffers are reused by the next one: take a new one only after the previous save finished.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], Any] = {}

    def copy(self, obj: Any) -> Any:
        """:return: ``obj`` with every tensor copied to host memory, containers rebuilt.

        CUDA copies are asynchronous and awaited before returning.
        """
        import torch

        devices: set[Any] = set()
        result = self._copy(obj, (), devices, torch)
        for device in devices:
            torch.cuda.current_stream(device).synchronize()
        return result

    def _copy(self, obj: Any, key: tuple[Any, ...], devices: set[Any], torch: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj.detach(), key, devices, torch)
        if isinstance(obj, dict):
            return {k: self._copy(v, key + (k,), devices, torch) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, key + (i,), devices, torch) for i, v in enumerate(obj))
        return obj

    def _tensor(self, tensor: Any, key: tuple[Any, ...], devices: set[Any], torch: Any) -> Any:
        if tensor.layout is not torch.strided or tensor.is_quantized:
            return tensor.to("cpu", copy=True)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pinned = tensor.is_cuda
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        if tensor.is_cuda:
            devices.add(tensor.device)
        return buffer

    @property
    def nbytes(self) -> int:
        """Bytes held in reusable buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


_CRC_LOCK = threading.Lock()


def save_without_crc32(state: Any, writer: Any) -> None:
    """``torch.save(state, writer)`` without the zip records' CRC-32 (the file's sha256 in the
    commit record already covers every byte; CRC-32 costs about as much as the write here).

    torch keeps that option process-wide: it is switched off only for this call, under a lock
    that serializes the manager's own saves. torch versions without the option save with it.
    """
    import torch

    getter = getattr(torch.serialization, "get_crc32_options", None)
    setter = getattr(torch.serialization, "set_crc32_options", None)
    if getter is None or setter is None:
        torch.save(state, writer)
        return
    with _CRC_LOCK:
        previous = getter()
        setter(False)
        try:
            torch.save(state, writer)
        finally:
            setter(previous)
