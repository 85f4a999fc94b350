"""The restore's private local copy of a checkpoint's bytes, verified while it is filled (the Cloud Storage FUSE
rule: a restore reads a checkpoint's bytes once), and :class:`ModulePlacement`: which of them go straight into the
tensors of the modules as they arrive."""

from __future__ import annotations

import copy as copy_module
import ctypes
import mmap
import os
import tempfile
import warnings
from typing import Any, BinaryIO, Callable

from gpu_resilience_worker.fastio import DIGEST_CHUNK, ChunkHasher, read_pipelined
from gpu_resilience_worker.torch_archive import ArchiveStream, Pickle, TensorRecord


class LocalCopy:
    """A private local copy of a file's bytes that ``torch.load(..., mmap=True)`` can map.

    On Linux an anonymous memory file (``memfd_create``) opened by path through ``/proc/self/fd``, elsewhere an
    unnamed-after-use temporary file: the one copy a restore holds; tensors loaded with ``mmap=True`` share its
    pages (freed once the copy is closed and they are gone). Where no such file can be made at that size, anonymous
    memory: ``path`` is then ``None`` and ``buffer`` holds the bytes (loading costs one more copy).

    With ``place`` (a file-backed copy only), each storage it gives an address for goes there as it arrives
    (:class:`~gpu_resilience_worker.torch_archive.ArchiveStream`), and the bytes it displaces go into the copy in
    its place. Until :meth:`keep_placed`, closing the copy puts them back (a checkpoint found torn or unloadable
    changes nothing); :meth:`unplace` swaps them back at once.

    :param size: bytes of the copy.
    :param place: for :class:`~gpu_resilience_worker.torch_archive.ArchiveStream`: the archive's
        pickle to ``{storage key: (bytes, address of a live CPU tensor's bytes or None)}``;
        default none placed.
    :raises ValueError: for a negative size.
    :raises OSError: when not even anonymous memory of that size can be had.
    """

    def __init__(self, size: int, place: Callable[[Any], dict[str, tuple[int, Any]]] | None = None) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size!r}")
        self.size = size
        self._temp: str | None = None
        self._fd = -1
        self.path: str | None = None
        self.buffer: mmap.mmap | None = None
        self._displaced: list[tuple[int, int, int]] = []  # (address, file offset, bytes)
        try:
            if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
                self._fd = os.memfd_create("checkpoint-copy", os.MFD_CLOEXEC)
                self.path = f"/proc/self/fd/{self._fd}"
            else:
                self._fd, self._temp = tempfile.mkstemp(prefix="checkpoint-copy-")
                self.path = self._temp
            os.ftruncate(self._fd, size)
        except OSError:
            self.close()
            self.path = None
            self.buffer = mmap.mmap(-1, max(size, 1))
        #: The archive followed while filling, when placing.
        self.archive = ArchiveStream(place) if place is not None and self.path is not None else None

    @property
    def displaced_bytes(self) -> int:
        """Bytes written to live tensors and not yet kept or put back."""
        return sum(count for _, _, count in self._displaced)

    @property
    def placed(self) -> dict[str, tuple[int, int]]:
        """``{storage key: (file offset, bytes)}`` of each storage written whole to its address."""
        return self.archive.placed if self.archive is not None else {}

    @property
    def in_memory(self) -> bool:
        """Whether ``path`` names memory of this process only (a ``memfd``), not a file."""
        return self.path is not None and self._temp is None

    def fill(self, handle: BinaryIO, chunk_bytes: int = DIGEST_CHUNK, digest: str = "sha256",
             stop: Callable[[], bool] | None = None) -> tuple[int, list[str]]:
        """Read ``handle`` into the copy in one sequential pass, hashing each piece as it lands.

        :param handle: an unbuffered binary file opened for reading, at its start.
        :param chunk_bytes: bytes per digest; default :data:`DIGEST_CHUNK`.
        :param digest: one of :data:`DIGESTS`; default ``sha256``.
        :param stop: asked before each :data:`CHUNK` read; when it returns true the fill ends
            with :class:`InterruptedError` (a SIGTERM during a restore); default never.
        :return: ``(bytes read, hex digest per chunk)``; the bytes read stop at ``size``, and
            one byte more counts (so a file longer than expected does not match).
        :raises OSError: when reading fails; :class:`InterruptedError` (an ``OSError``) when
            ``stop`` said so.
        """
        hasher = ChunkHasher(chunk_bytes, digest)
        if self.size == 0:
            return len(handle.read(1) or b""), []
        position = read_pipelined(handle, lambda view, offset: self._absorb(hasher, view, offset), self.size, stop)
        for segment in self.archive.finish() if self.archive is not None else ():
            self._put(*segment)
        extra = len(handle.read(1) or b"") if position == self.size else 0
        return position + extra, hasher.digests()

    def _absorb(self, hasher: ChunkHasher, view: memoryview, offset: int) -> None:
        """Put a piece into the copy (or its storages' parts to their addresses), then hash it
        (in that order it kept up with a cold read)."""
        for segment in self.archive.feed(view, offset) if self.archive is not None else [(offset, view, None, 0)]:
            self._put(*segment)
        hasher.update(view)

    def _put(self, offset: int, piece: memoryview, address: int | None, into: int) -> None:
        """Write ``piece`` (file bytes at ``offset``) into the file with ``pwrite`` (no page fault per page), or into
        the anonymous memory; or at ``address + into``, the bytes there first written to the copy in its place."""
        if address is not None:
            target = address + into
            self._pwrite((ctypes.c_char * piece.nbytes).from_address(target), offset)
            self._displaced.append((target, offset, piece.nbytes))
            ctypes.memmove(target, ctypes.addressof(ctypes.c_char.from_buffer(piece)), piece.nbytes)
        elif self.buffer is not None:
            self.buffer[offset : offset + piece.nbytes] = piece
        else:
            self._pwrite(piece, offset)

    def _pwrite(self, piece: Any, position: int) -> None:
        piece = memoryview(piece)
        while piece.nbytes:
            written = os.pwrite(self._fd, piece, position)
            piece, position = piece[written:], position + written

    def keep_placed(self) -> None:
        """The placed storages stay in the live tensors (they were loaded): closing keeps them."""
        self._displaced.clear()

    def unplace(self) -> None:
        """Swap every placed part back: the live tensors get their values back, the copy the file's bytes."""
        self._give_back(swap=True)
        self.placed.clear()

    def _give_back(self, swap: bool = False) -> None:
        for target, offset, count in reversed(self._displaced):
            memory = (ctypes.c_char * count).from_address(target)
            placed = bytes(memory) if swap else b""
            os.preadv(self._fd, [memory], offset)
            self._pwrite(placed, offset)
        self._displaced.clear()

    def close(self) -> None:
        """Close (and, for a temporary file, delete) the copy; mappings of it stay valid. The live
        tensors get back what a placement displaced, unless :meth:`keep_placed` was called."""
        if self._displaced and self._fd >= 0:
            self._give_back()
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._temp is not None:
            try:
                os.remove(self._temp)
            except OSError:
                pass
            self._temp = None

    def __enter__(self) -> LocalCopy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ModulePlacement:
    """Which storages of a checkpoint go straight into the tensors of ``torch.nn.Module`` states (a
    :class:`LocalCopy`'s ``place``): those every use of which is a whole ``state_dict()`` entry (not
    ``_extra_state``) of a module that saves and loads as torch's own code does (no override, no state-dict hook,
    every ``_save_to_state_dict``/``_load_from_state_dict`` from ``torch.nn``: ``load_state_dict`` copies each
    entry into that very tensor), whose live tensor is a plain CPU, strided, contiguous tensor of the same dtype,
    shape and elements, not a conjugate or negative view, sharing its bytes with no other such storage.

    :param states: the states by name (``CheckpointManager``'s). Their ``state_dict()`` is taken
        here, on the caller's thread (the read calls the placement on another).
    """

    def __init__(self, states: dict[str, Any]) -> None:
        import torch

        self._torch = torch
        self._modules = {name: s.state_dict() for name, s in states.items() if _saves_as_torch_does(s, torch)}
        self._targets: dict[str, list[tuple[Any, Any, Any]]] = {}  # key -> [(state, entry, live tensor)]

    def __call__(self, records: Pickle) -> dict[str, tuple[int, int | None]]:
        torch = self._torch
        sizes, dtypes = {}, {key: _storage_dtype(storage.type_name, torch) for key, storage in records.storages.items()}
        for key, storage in records.storages.items():  # an untyped storage counts bytes
            if (dtype := dtypes[key]) is not None or storage.type_name == "UntypedStorage":
                sizes[key] = storage.numel * (dtype.itemsize if dtype is not None else 1)
        uses: dict[str, list[tuple[tuple[Any, ...], Any]]] = {}
        for path, record in records.tensors.items():
            live = self._modules[path[0]].get(path[1]) if len(path) == 2 and path[0] in self._modules else None
            fits = _fits(record, dtypes[record.storage.key], live, torch)
            uses.setdefault(record.storage.key, []).append((path, live if fits and not str(path[1]).endswith(
                "_extra_state") else None))
        candidates = sorted((found[0][1].data_ptr(), key, found) for key, found in uses.items()
                            if key not in records.shared and all(live is not None for _, live in found)
                            and len({live.data_ptr() for _, live in found}) == 1)
        self._targets, last_end, last = {}, 0, None
        for start, key, found in candidates:  # by address; storages bound for shared bytes are loaded
            if start < last_end:  # (load_state_dict's order decides which one they end with)
                self._targets.pop(last, None)
            else:
                self._targets[key] = [(path[0], path[1], live) for path, live in found]
            if start + sizes[key] > last_end:
                last_end, last = start + sizes[key], key
        return {key: (size, self._targets[key][0][2].data_ptr() if key in self._targets else None)
                for key, size in sizes.items()}

    def check(self, copy: LocalCopy) -> bool:
        """Whether torch reads the pickle ``copy`` followed and each storage it placed where they were, no record
        shares a byte with another, and nothing else was placed (torch's own reader of the archive, on the copy)."""
        import torch

        reader = getattr(torch._C, "PyTorchFileReader", None)
        if reader is None or copy.archive is None or copy.displaced_bytes != sum(n for _, n in copy.placed.values()):
            return False
        archive = reader(copy.path)  # in a whole archive no two records share a byte
        spans = sorted((archive.get_record_offset(name), archive.get_record_size(name), name)
                       for name in archive.get_all_records())
        found = {name: (offset, size) for offset, size, name in spans}
        return (all(offset + size <= after for (offset, size, _), (after, _, _) in zip(spans, spans[1:]))
                and found.get("data.pkl") == copy.archive.pickle
                and all(found.get(f"data/{key}") == spot for key, spot in copy.placed.items()))

    def into(self, state: dict[str, Any], placed: dict[str, Any]) -> dict[str, Any]:
        """``state`` as loaded (unchanged) with each placed entry replaced by its live tensor, which
        ``load_state_dict`` then leaves as it is (torch copies nothing onto itself)."""
        result = dict(state)
        for key in placed:
            for name, entry, live in self._targets.get(key, ()):
                if result[name] is state[name]:
                    result[name] = copy_module.copy(state[name])  # an OrderedDict keeps its _metadata
                result[name][entry] = live
        return result


_SAVE_AND_LOAD = ("state_dict", "load_state_dict", "_save_to_state_dict", "_load_from_state_dict")


def _saves_as_torch_does(state: Any, torch: Any) -> bool:
    """Whether ``state`` is a module whose saving and loading are torch's own through and through: each of
    :data:`_SAVE_AND_LOAD` defined by a ``torch.nn`` class (not on an instance, not by a subclass), no state-dict hook."""
    return isinstance(state, torch.nn.Module) and all(
        not (m._state_dict_hooks or m._state_dict_pre_hooks or m._load_state_dict_pre_hooks)
        and not any(name in vars(m) for name in _SAVE_AND_LOAD)
        and all(next(c for c in type(m).__mro__ if name in vars(c)).__module__.startswith("torch.nn.")
                for name in _SAVE_AND_LOAD) for m in state.modules())


def _storage_dtype(type_name: str, torch: Any) -> Any:
    """:return: the dtype of a storage type the pickle names (``FloatStorage``), or ``None``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy storage classes warn when touched
        dtype = getattr(getattr(torch, type_name, None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _fits(record: TensorRecord, dtype: Any, live: Any, torch: Any) -> bool:
    """Whether ``live`` can take the storage of ``record`` byte for byte."""
    return (type(live) in (torch.Tensor, torch.nn.Parameter) and live.device.type == "cpu"
            and live.layout is torch.strided and not live.is_quantized and not live.is_conj()
            and not live.is_neg() and live.is_contiguous() and live.dtype == dtype and live.numel() > 0
            and record.offset == 0 and record.storage.numel == live.numel()
            and record.shape == tuple(live.shape) and record.stride == tuple(live.stride()))
