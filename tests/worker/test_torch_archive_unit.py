"""The archive as it streams past: every byte comes out once, in order, and each storage's bytes are
found where torch's own reader finds them; what the stream cannot follow ends the following, not the read."""

from __future__ import annotations

import io
import os
import random
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_resilience_worker.torch_archive import ArchiveStream, Pickle, read_records
from tests.worker.test_restore_placement_unit import Net, _train


def _archive() -> bytes:
    torch.manual_seed(0)
    model = Net(32)
    optimizer = torch.optim.Adam(model.parameters())
    _train(model, optimizer, 1, seed=1)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 7}, buffer)
    return buffer.getvalue()


def _stream(data: bytes, place, pieces: list[int]) -> tuple[ArchiveStream, list[tuple[int, bytes, Any, int]]]:
    stream, segments, position = ArchiveStream(place), [], 0
    for size in pieces:
        view = memoryview(bytearray(data[position : position + size]))
        segments += [(at, bytes(b), d, into) for at, b, d, into in stream.feed(view, position)]
        position += view.nbytes
    return stream, segments + [(at, bytes(b), d, into) for at, b, d, into in stream.finish()]


@pytest.mark.parametrize("seed", range(8))
def test_the_stream_splits_any_pieces_into_the_file_and_the_storages_where_torch_reads_them(tmp_path: Path,
                                                                                              seed: int) -> None:
    data = _archive()
    (tmp_path / "a.pt").write_bytes(data)
    reader = torch._C.PyTorchFileReader(str(tmp_path / "a.pt"))

    def place(records: Pickle) -> dict[str, tuple[int, Any]]:  # every other storage has a destination
        return {key: (reader.get_record_size(f"data/{key}"), key if int(key) % 2 else None) for key in records.storages}

    rng = random.Random(seed)
    pieces = [rng.choice([1, 3, 30, 64, 517, 4096, 1 << 16]) for _ in range(len(data))]
    stream, segments = _stream(data, place, pieces)
    assert b"".join(b for _, b, _, _ in segments) == data
    assert [at for at, *_ in segments] == [sum(len(b) for _, b, _, _ in segments[:i]) for i in range(len(segments))]
    for at, _, key, into in segments:
        if key is not None:
            assert at - into == reader.get_record_offset(f"data/{key}")
    keys = [name.rsplit("/", 1)[-1] for name in reader.get_all_records() if name.startswith("data/")]
    assert stream.placed == {k: (reader.get_record_offset(f"data/{k}"), reader.get_record_size(f"data/{k}"))
                             for k in keys if int(k) % 2}


def _everything(records: Pickle) -> dict[str, tuple[int, Any]]:
    return {key: (storage.numel * 4, "somewhere") for key, storage in records.storages.items()}


@pytest.mark.parametrize("case, place, mangle", [
    ("not an archive", _everything, lambda d: os.urandom(len(d))),
    ("the pickle cannot be followed", lambda records: 1 / 0, lambda d: d),
    ("a storage the pickle does not name", lambda records: {}, lambda d: d),
    ("the stream ends inside a storage", _everything, lambda d: d[: len(d) // 2]),
    ("the archive is cut after its pickle", _everything, lambda d: d[:900]),
])
def test_what_the_stream_cannot_follow_ends_the_following_and_every_byte_still_comes_out(case: str, place, mangle) -> None:
    data = mangle(_archive())
    stream, segments = _stream(data, place, [1000] * (len(data) // 1000 + 1))
    assert b"".join(b for _, b, _, _ in segments) == data, case
    complete = {key for key, (start, size) in stream.placed.items() if start + size <= len(data)}
    assert complete == set(stream.placed), case


_T = torch.arange(12, dtype=torch.float32).reshape(3, 4)


@pytest.mark.parametrize("case, obj, tensors, shared", [
    ("entries of their own", {"a": _T, "b": {"c": [_T.clone()]}}, [("a",), ("b", "c", 0)], set()),
    ("one tensor twice", {"a": _T, "b": _T}, [("a",), ("b",)], set()),
    ("a view of another entry", {"a": _T, "b": _T[1]}, [("a",), ("b",)], set()),
    ("a parameter on an entry's storage", {"a": _T, "b": torch.nn.Parameter(_T)}, [("a",)], {"0"}),
    ("a conjugate view", {"c": torch.ones(3, dtype=torch.complex64).conj()}, [], {"0"}),
])
def test_the_pickle_names_each_tensor_by_path_and_the_storages_something_else_uses(case, obj, tensors, shared) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        records = read_records(archive.read("archive/data.pkl"))
    assert sorted(records.tensors) == sorted(tensors), case
    assert records.shared == shared, case
    assert all(storage.type_name.endswith("Storage") for storage in records.storages.values()), case


def test_an_archive_of_another_byte_order_is_not_placed() -> None:
    data = bytearray(_archive())
    at = data.index(b"little")  # the byteorder record's content; torch would byte-swap the storages
    data[at : at + 6] = b"LITTLE"
    stream, segments = _stream(bytes(data), _everything, [4096] * (len(data) // 4096 + 1))
    assert b"".join(b for _, b, _, _ in segments) == data and stream.placed == {}
    assert _stream(_archive(), _everything, [len(data)])[0].placed  # the unmangled archive is
