"""Fast paths for big checkpoints' bytes: the hashing writer, early writeback, pipelined reads, and chunk
digests on parallel threads: a data file is hashed as a *hash list* (the commit record's ``chunks``, see
:mod:`gpu_resilience_worker.task_folder`), its chunks on several threads at once (``hashlib`` and file reads
and writes release the GIL on large buffers)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import hashlib
import mmap
import os
import sys
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, BinaryIO, Callable

from gpu_resilience_worker.task_folder import DIGEST_CHUNK, DIGESTS, HEX_CHARS, root_digest  # noqa: F401 - re-exported

#: Bytes per write (and per read) of big records, in bytes (8 MiB).
CHUNK = 8 << 20
#: Writes shorter than this are buffered and hashed inline, in bytes (1 MiB).
SMALL_WRITE = 1 << 20
#: Threads hashing chunks: the CPU count, at least 2, at most 8.
HASH_THREADS = max(2, min(8, os.cpu_count() or 2))

_POOL_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    """:return: the helper threads that hash while the caller does I/O, all of them started."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            pool = ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="sha256")
            # every thread started now, from here: a pool starts one per submit, from the submitting thread, and one
            # started in forkguard.write_privately would share that write's descriptor table, keeping it all open
            started = threading.Barrier(HASH_THREADS)
            wait([pool.submit(started.wait, 30.0) for _ in range(HASH_THREADS)])  # a broken barrier: no error
            _POOL = pool
        return _POOL


def start_hash_threads() -> None:
    """Start the hashing threads now, in the calling thread, if they are not running yet (call it
    before a write that hashes runs in :func:`~gpu_resilience_worker.forkguard.write_privately`)."""
    _pool()


class _Crc32:
    """``zlib.crc32`` behind the ``update``/``hexdigest`` interface of :mod:`hashlib`."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


@functools.cache
def _crc32c_extend() -> Any:
    """:return: ``crc32c_extend(crc, pointer, length)`` of the C library ``google-crc32c`` ships,
    through ctypes (no copy of the buffer, the GIL released), or ``None`` when not found."""
    with contextlib.suppress(ImportError, OSError, AttributeError):
        import google_crc32c

        folder = os.path.dirname(os.path.dirname(google_crc32c.__file__))
        for library in sorted(glob.glob(os.path.join(folder, "google_crc32c.libs", "libcrc32c*.so*"))):
            function = ctypes.CDLL(library).crc32c_extend
            function.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
            function.restype = ctypes.c_uint32
            return function
    return None


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (stable since Python 3.3), to reach a read-only buffer's memory."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_GET_BUFFER = ctypes.pythonapi.PyObject_GetBuffer
_GET_BUFFER.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_GET_BUFFER.restype = ctypes.c_int
_RELEASE_BUFFER = ctypes.pythonapi.PyBuffer_Release
_RELEASE_BUFFER.argtypes = [ctypes.POINTER(_PyBuffer)]
_RELEASE_BUFFER.restype = None


class _Crc32c(_Crc32):
    """CRC-32C: ``google-crc32c``'s C library called on the buffer in place, read-only too (a restore hashes a read-only
    map of the checkpoint), through the buffer protocol; without it, its extension module (``bytes`` only: a copy)."""

    def __init__(self) -> None:
        import google_crc32c

        self._extend, self._module, self._value = _crc32c_extend(), google_crc32c, 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")  # C-contiguous bytes, or TypeError
        if not view.nbytes:
            return
        if self._extend is None:
            self._value = self._module.extend(self._value, bytes(view))
            return
        buffer = _PyBuffer()
        if _GET_BUFFER(view, ctypes.byref(buffer), 0) != 0:  # PyBUF_SIMPLE; raises on failure
            raise BufferError("no buffer")
        try:
            self._value = self._extend(self._value, buffer.buf, buffer.len)
        finally:
            _RELEASE_BUFFER(ctypes.byref(buffer))


def crc32c_available() -> bool:
    """:return: whether ``google-crc32c`` is importable with its C (hardware) implementation."""
    try:
        import google_crc32c
    except ImportError:
        return False
    return getattr(google_crc32c, "implementation", "") == "c"


def default_digest() -> str:
    """
    :return: the chunk digest new checkpoints use: ``crc32c`` when :func:`crc32c_available`, else ``crc32``
        (``zlib``); cheaper than sha256 and, with the size in the commit record, as sure to catch a torn file."""
    return "crc32c" if crc32c_available() else "crc32"


def new_hasher(digest: str) -> Any:
    """:return: a fresh hasher of ``digest`` with ``update(buffer)`` and ``hexdigest()``.

    :param digest: one of :data:`DIGESTS`.
    :raises ValueError: for another name; :raises ImportError: for ``crc32c`` without ``google-crc32c``.
    """
    if digest not in DIGESTS:
        raise ValueError(f"digest must be one of {DIGESTS}, got {digest!r}")
    return {"sha256": hashlib.sha256, "crc32": _Crc32, "crc32c": _Crc32c}[digest]()


def chunk_digests(data: bytes | memoryview, chunk_bytes: int = DIGEST_CHUNK, digest: str = "sha256") -> list[str]:
    """:return: the hex ``digest`` of every ``chunk_bytes`` bytes of ``data`` (empty for no data)."""
    hasher = ChunkHasher(chunk_bytes, digest)
    hasher.update(memoryview(data).cast("B"))
    return hasher.digests()


class ChunkHasher:
    """The hash list of a byte stream fed in order: sha256 chunks hashed on the helper threads, CRC chunks inline
    (cheaper than handing them over), unless ``parallel`` (bytes in memory: nothing to overlap the hashing with).

    :param chunk_bytes: bytes per digest; default :data:`DIGEST_CHUNK`.
    :param digest: one of :data:`DIGESTS`; default ``sha256``.
    :param parallel: hash every chunk on the helper threads; default for ``sha256`` only.
    """

    def __init__(self, chunk_bytes: int = DIGEST_CHUNK, digest: str = "sha256", parallel: bool | None = None) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes!r}")
        new_hasher(digest)  # validates the name
        self.chunk_bytes, self.digest = chunk_bytes, digest
        self.parallel = digest == "sha256" if parallel is None else parallel
        self.size = 0
        self._hashers: list[Any] = []

    def submit(self, view: memoryview) -> list[Future]:
        """Start hashing ``view`` (the next bytes of the stream), one task per chunk it touches. Wait for the
        returned futures before ``view`` changes or is released, and before the next :meth:`submit` (a chunk's
        pieces are hashed in order)."""
        groups: list[tuple[Any, list[memoryview]]] = []
        position = 0
        while position < view.nbytes:
            while len(self._hashers) <= self.size // self.chunk_bytes:
                self._hashers.append(new_hasher(self.digest))
            hasher = self._hashers[-1]
            take = min(self.chunk_bytes - self.size % self.chunk_bytes, view.nbytes - position)
            piece = view[position : position + take]
            if groups and groups[-1][0] is hasher:
                groups[-1][1].append(piece)
            else:
                groups.append((hasher, [piece]))
            position += take
            self.size += take
        if not self.parallel:  # inline: one pass, on the thread that writes or reads
            for hasher, pieces in groups:
                _update_all(hasher, pieces)
            return []
        pool = _pool()
        return [pool.submit(_update_all, hasher, pieces) for hasher, pieces in groups]

    def update(self, view: memoryview) -> None:
        """Hash ``view`` (the next bytes of the stream) and wait for it."""
        for future in self.submit(view):
            future.result()

    def digests(self) -> list[str]:
        """:return: the hex digest of every chunk so far, in order (all submits awaited)."""
        return [hasher.hexdigest() for hasher in self._hashers]


def _update_all(hasher: Any, pieces: list[memoryview]) -> None:
    for piece in pieces:
        hasher.update(piece)


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = ...  # ``...`` until looked up; ``None`` where missing or refused


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` of ``fd`` to disk, without waiting (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so that the final ``fsync`` finds little left to flush. A hint:
    elsewhere, or once the call fails (FUSE mounts may refuse it), it does nothing; durability comes from ``fsync``.

    :param fd: a file descriptor open for writing.
    :param offset: byte offset of the range.
    :param length: bytes in the range.
    """
    global _sync_file_range
    if _sync_file_range is ...:
        _sync_file_range = None
        with contextlib.suppress(OSError, AttributeError):
            if sys.platform.startswith("linux"):
                function = ctypes.CDLL(None, use_errno=True).sync_file_range  # libc, loaded by Python
                function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                function.restype = ctypes.c_int
                _sync_file_range = function
    if _sync_file_range is not None and _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE) != 0:
        _sync_file_range = None  # unsupported here: stop asking


def _write_all(handle: BinaryIO, view: memoryview) -> None:
    """Write all of ``view`` (a raw file may write less than asked)."""
    while view.nbytes:
        written = handle.write(view)
        view = view[written if written is not None else view.nbytes:]


class HashingWriter:
    """A write-only file object (for ``torch.save``) that builds the hash list of what goes through it, and counts
    it. The calling thread writes big records in :data:`CHUNK` pieces, starting each one's writeback, while the
    helper threads hash them (a task per :data:`DIGEST_CHUNK` chunk); with a CRC ``digest`` it hashes each piece,
    then writes it (one pass, no helper thread competing with training). Small records are buffered. Every record is
    hashed before :meth:`write` returns (a view is valid only during the call).

    :param handle: an unbuffered binary file opened for writing, at its start.
    :param chunk_bytes: bytes per digest; default :data:`DIGEST_CHUNK`.
    :param digest: one of :data:`DIGESTS`; default ``sha256``.
    """

    def __init__(self, handle: BinaryIO, chunk_bytes: int = DIGEST_CHUNK, digest: str = "sha256") -> None:
        self._handle, self._hasher = handle, ChunkHasher(chunk_bytes, digest)
        self._small, self._written = bytearray(), 0
        try:
            self._fd: int | None = handle.fileno()
        except (AttributeError, OSError, ValueError):
            self._fd = None

    @property
    def size(self) -> int:
        """Bytes taken so far (written or buffered)."""
        return self._written + len(self._small)

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
        return view.nbytes

    def _overlapped(self, view: memoryview) -> None:
        inline = not self._hasher.parallel
        pending = [] if inline else self._hasher.submit(view)
        try:
            for offset in range(0, view.nbytes, CHUNK):
                piece = view[offset : offset + CHUNK]
                if inline:  # hash the piece while it is hot in the cache, then write it
                    self._hasher.submit(piece)
                _write_all(self._handle, piece)
                if self._fd is not None:
                    start_writeback(self._fd, self._written, piece.nbytes)
                self._written += piece.nbytes
        finally:
            for hashed in pending:
                hashed.result()

    def _drain(self) -> None:
        if self._small:
            small, self._small = memoryview(self._small), bytearray()
            self._hasher.update(small)
            _write_all(self._handle, small)
            self._written += small.nbytes

    def flush(self) -> None:
        """Write out buffered small records."""
        self._drain()

    def digests(self) -> list[str]:
        """:return: the hash list of everything written (hex sha256 per chunk), after flushing."""
        self._drain()
        return self._hasher.digests()


def file_chunk_digests(path: str, chunk_bytes: int = DIGEST_CHUNK, digest: str = "sha256") -> tuple[int, list[str]]:
    """The hash list of a local file, its chunks hashed in parallel through a read-only memory
    map (no copy into user buffers; the pages stay cached for a memory-mapped ``torch.load``).

    :param path: a local (or FUSE-mounted) file.
    :param chunk_bytes: bytes per digest; default :data:`DIGEST_CHUNK`.
    :param digest: one of :data:`DIGESTS`; default ``sha256``.
    :return: ``(size in bytes, hex digest per chunk)``.
    :raises OSError: when the file cannot be opened or mapped.
    """
    hasher = ChunkHasher(chunk_bytes, digest, parallel=True)
    with open(path, "rb", buffering=0) as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return 0, []
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            if hasattr(mapped, "madvise"):
                mapped.madvise(mmap.MADV_WILLNEED)
            with memoryview(mapped) as view:
                pending = hasher.submit(view)
                wait(pending)  # every task ends before the map closes, even when one failed
                for future in pending:
                    future.result()
    return hasher.size, hasher.digests()


def read_pipelined(handle: BinaryIO, absorb: Callable[[memoryview, int], None], limit: int | None = None,
                   stop: Callable[[], bool] | None = None) -> int:
    """Read ``handle`` sequentially into two reused :data:`CHUNK` buffers in turn; a helper thread
    hands each piece to ``absorb`` (it hashes it, and may write it somewhere) while the next is read.

    :param handle: an unbuffered binary file opened for reading.
    :param absorb: called with each piece and its offset, in order, on the helper thread.
    :param limit: bytes to read at most; default to the end.
    :param stop: asked before each read; when it returns true, reading ends with
        :class:`InterruptedError` (an ``OSError``: a SIGTERM during a restore); default never.
    :return: the bytes read.
    :raises OSError: when reading fails, or from ``stop``; what ``absorb`` raises.
    """
    buffers = [memoryview(bytearray(CHUNK)), memoryview(bytearray(CHUNK))]
    pending: Future | None = None
    position = 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-pipelined") as helper:
        try:
            while limit is None or position < limit:
                if stop is not None and stop():
                    raise InterruptedError(f"reading stopped after {position} bytes: a stop was requested")
                count = handle.readinto(buffers[0][: CHUNK if limit is None else min(CHUNK, limit - position)]) or 0
                if pending is not None:
                    pending.result()
                    pending = None
                if count == 0:
                    break
                pending = helper.submit(absorb, buffers[0][:count], position)
                position += count
                buffers.reverse()
        finally:
            if pending is not None:
                pending.result()
    return position


def stream_chunk_digests(handle: BinaryIO, chunk_bytes: int = DIGEST_CHUNK, digest: str = "sha256") -> tuple[int, list[str]]:
    """The hash list of ``handle`` read to its end, each piece hashed while the next is read (:func:`read_pipelined`).

    :param handle: an unbuffered binary file opened for reading.
    :param chunk_bytes: bytes per digest; default :data:`DIGEST_CHUNK`.
    :param digest: one of :data:`DIGESTS`; default ``sha256``.
    :return: ``(size in bytes, hex digest per chunk)``.
    :raises OSError: when reading fails.
    """
    hasher = ChunkHasher(chunk_bytes, digest)
    read_pipelined(handle, lambda view, _: hasher.update(view))
    return hasher.size, hasher.digests()
