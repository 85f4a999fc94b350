"""Where a ``torch.save`` archive keeps each storage's bytes, found while it streams in: the zip's first record is
the pickle (``<prefix>/data.pkl``: each tensor's storage by key, type and elements), then small records and one per
storage (``<prefix>/data/<key>``), each after a local header without sizes and before a data descriptor.
:class:`ArchiveStream` follows that from the bytes alone; what it does not expect ends the following, not the read."""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
from typing import Any, Callable, NamedTuple

LOCAL, DESCRIPTOR, CENTRAL = b"PK\x03\x04", b"PK\x07\x08", b"PK\x01\x02"
#: The largest pickle followed (bytes).
PICKLE_LIMIT = 64 << 20


class StorageRef(NamedTuple):
    """A storage as the pickle names it: its type's name (``FloatStorage``), key and elements."""

    type_name: str
    key: str
    numel: int


class TensorRecord(NamedTuple):
    """A tensor as the pickle rebuilds it (``torch._utils._rebuild_tensor_v2``'s first arguments)."""

    storage: StorageRef
    offset: int
    shape: tuple
    stride: tuple


class _Opaque:
    """Whatever else the pickle builds: taken and ignored (nothing is imported, nothing runs)."""

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class Pickle(NamedTuple):
    """What a restore needs of the archive's pickle: ``tensors`` by path of dict keys and list indices, every storage
    by key, and the keys of those ``shared`` with something else (a tensor inside an object not followed here)."""

    tensors: dict[tuple, TensorRecord]
    storages: dict[str, StorageRef]
    shared: set[str]


class _RecordUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.uses: collections.Counter = collections.Counter()  # persistent ids per storage key
        self.built: list[TensorRecord] = []
        self.storages: dict[str, StorageRef] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "torch" and name.endswith("Storage"):
            return name  # a typed storage's class (``FloatStorage``), or ``UntypedStorage`` (numel in bytes)
        known = {("torch._utils", "_rebuild_tensor_v2"): self._tensor, ("collections", "OrderedDict"): collections.OrderedDict}
        return known.get((module, name), _Opaque)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], str)):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        storage = self.storages.setdefault(str(pid[2]), StorageRef(pid[1], str(pid[2]), int(pid[4])))
        self.uses[storage.key] += 1
        return storage

    def _tensor(self, storage: Any, offset: Any, shape: Any, stride: Any, *rest: Any) -> Any:
        """``_rebuild_tensor_v2``; a tensor with metadata (a conjugate view, say) stays opaque."""
        if not (isinstance(storage, StorageRef) and isinstance(shape, tuple) and isinstance(stride, tuple)) or (
                len(rest) > 2 and rest[2]):
            return _Opaque()
        self.built.append(TensorRecord(storage, int(offset), shape, stride))
        return self.built[-1]


def _paths(obj: Any, path: tuple, out: dict[tuple, TensorRecord]) -> dict[tuple, TensorRecord]:
    if isinstance(obj, TensorRecord):
        out[path] = obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _paths(value, path + (key,), out)
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, StorageRef):
        for index, value in enumerate(obj):
            _paths(value, path + (index,), out)
    return out


def read_records(data: bytes) -> Pickle:
    """Read the archive's pickle (``data``: ``<prefix>/data.pkl``) without importing any class (whatever else it
    builds is opaque); malformed bytes raise what unpickling raises."""
    reader = _RecordUnpickler(data)
    tensors = _paths(reader.load(), (), {})
    reached = {id(record) for record in tensors.values()}
    built = collections.Counter(record.storage.key for record in reader.built)
    shared = {r.storage.key for r in reader.built if id(r) not in reached}
    return Pickle(tensors, reader.storages, shared | {key for key, n in reader.uses.items() if n > built[key]})


#: A part of the stream: ``(file offset, its bytes, destination or None, offset in the destination)``.
Segment = tuple[int, memoryview, Any, int]


class ArchiveStream:
    """Splits a torch archive's bytes, fed in order, into parts to store as they are and parts
    of a storage that has a destination. The bytes of every segment are writable.

    :param place: called with the pickle (:func:`read_records`): ``{storage key: (bytes,
        destination or None)}``. A storage it leaves out, one before the pickle, or any in an
        archive of another byte order than this machine's ends the following.
    """

    def __init__(self, place: Callable[[Any], dict[str, tuple[int, Any]]]) -> None:
        self._place, self._storages = place, None
        self._pending = bytearray()  # the bytes from self._at on, not yet classified
        self._at, self._mode, self._prefix, self._name = 0, "header", "", ""
        self._data: tuple[int, int, Any] = (0, 0, None)  # a storage's first byte, end, destination
        self._scanned, self._native = 0, False
        #: ``(data offset, bytes)`` of the pickle followed.
        self.pickle: tuple[int, int] | None = None
        #: ``{key: (data offset, bytes)}`` of each storage sent whole to its destination.
        self.placed: dict[str, tuple[int, int]] = {}

    def feed(self, view: memoryview, offset: int) -> list[Segment]:
        """:param view: the next piece of the file, at ``offset``.
        :return: the segments of ``view`` and of bytes held back before, in file order."""
        out: list[Segment] = []
        position, end = offset, offset + view.nbytes
        while True:
            if self._mode in ("data", "done"):
                position = self._pass(view, offset, position, end, out)
                if position >= end and not self._pending:
                    return out
            elif not self._parse(out):
                if position >= end:
                    return out
                take = min(end, position + max(1, self._want()))
                self._pending += view[position - offset : take - offset]
                position = take

    def finish(self) -> list[Segment]:
        """:return: the bytes still held back (the stream ended)."""
        out = [(self._at, memoryview(bytearray(self._pending)), None, 0)] if self._pending else []
        self._pending, self._mode = bytearray(), "done"
        return out

    def _pass(self, view: memoryview, offset: int, position: int, end: int, out: list[Segment]) -> int:
        """Pass on held-back bytes, else the view's, up to the storage's end (or all when done)."""
        start, stop, destination = self._data if self._mode == "data" else (0, 1 << 62, None)
        if self._pending:
            count = min(len(self._pending), stop - self._at)
            piece = memoryview(bytearray(self._pending[:count]))
            del self._pending[:count]
        else:
            count = min(end, stop) - position
            piece, position = view[position - offset : position - offset + count], position + count
        if count:
            out.append((self._at, piece, destination, self._at - start))
        self._at += count
        if self._mode == "data" and self._at == stop:
            if destination is not None:
                self.placed[self._name] = (start, stop - start)
            self._mode = "descriptor"
        return position

    def _want(self) -> int:
        if self._mode == "descriptor":
            return 28 - len(self._pending)
        if self._mode == "header" and len(self._pending) >= 30:
            name_length, extra_length = struct.unpack_from("<HH", self._pending, 26)
            return 30 + name_length + extra_length - len(self._pending)
        return 30 - len(self._pending) if self._mode == "header" else 64 << 10

    def _parse(self, out: list[Segment]) -> bool:
        """Classify what the held-back bytes allow. :return: whether anything changed."""
        pending = self._pending
        if self._mode == "header":
            if len(pending) >= 4 and pending[:4] != LOCAL:
                self._mode = "done"
                return True
            return len(pending) >= 30 and self._want() <= 0 and self._header(out)
        if self._mode == "descriptor":  # 16 bytes, or 24 with 64-bit sizes; torch writes none after an empty one
            if self._data[0] == self._data[1] and len(pending) >= 4 and pending[:4] in (LOCAL, CENTRAL):
                self._mode = "header"
                return True
            return self._ended(0, self._data[1] - self._data[0], out, last=True)
        while (found := pending.find(DESCRIPTOR, self._scanned)) >= 0:  # a record of unknown size
            if len(pending) < found + 28 or self._ended(found, found, out):
                return self._mode != "record"  # it ended (the bytes held back are then fewer)
            self._scanned = found + 1
        self._scanned = max(0, len(pending) - 3)
        if len(pending) > PICKLE_LIMIT:
            self._mode = "done"
        return self._mode == "done"

    def _ended(self, at: int, size: int, out: list[Segment], last: bool = False) -> bool:
        """Whether a descriptor at ``at`` in the held-back bytes gives ``size`` and is followed by
        a header; if so the record ends there. ``last``: no other descriptor may come."""
        pending = self._pending
        for length, form in ((16, "<I"), (24, "<Q")):
            if len(pending) < at + length + 4:
                return False
            if (pending[at : at + 4] == DESCRIPTOR and pending[at + length : at + length + 4] in (LOCAL, CENTRAL)
                    and struct.unpack_from(form, pending, at + length - struct.calcsize(form))[0] == size):
                return self._record_ends(at, length, out)
        if last:
            self.placed.pop(self._name, None)
            self._mode = "done"
        return last

    def _record_ends(self, size: int, descriptor: int, out: list[Segment]) -> bool:
        if self._mode == "record" and self._name == "byteorder":  # torch byte-swaps another order
            self._native = bytes(self._pending[:size]) == sys.byteorder.encode()
        if self._mode == "record" and self._name == "data.pkl" and self._storages is None:
            try:
                self.pickle = (self._at, size)
                self._storages = self._place(read_records(bytes(self._pending[:size])))
            except Exception:  # noqa: BLE001 - a pickle it cannot follow: nothing is placed
                self._mode = "done"
                return True
        self._structure(size + descriptor, out, "header")
        return True

    def _structure(self, count: int, out: list[Segment], mode: str) -> None:
        out.append((self._at, memoryview(bytearray(self._pending[:count])), None, 0))
        del self._pending[:count]
        self._at, self._mode, self._scanned = self._at + count, mode, 0

    def _header(self, out: list[Segment]) -> bool:
        name_length, extra_length = struct.unpack_from("<HH", self._pending, 26)
        name = self._pending[30 : 30 + name_length].decode("utf-8", "replace")
        self._structure(30 + name_length + extra_length, out, "record")
        if name.endswith("/data.pkl") and self._storages is None:
            self._prefix, self._name = name[: -len("data.pkl")], "data.pkl"
        elif self._storages is not None and name.startswith(f"{self._prefix}data/"):
            self._name = name[len(self._prefix) + 5 :]
            entry = self._storages.get(self._name) if self._native else None
            self._mode = "done" if entry is None else "data"
            self._data = (self._at, self._at + entry[0], entry[1]) if entry else self._data
        else:
            self._name = name.rsplit("/", 1)[-1]
            self._mode = "done" if "/data/" in name else "record"
        return True
