"""The commit-record schema (``gpu_resilience_worker.task_folder``): both shapes, the format version,
a newer release's record told apart from a torn one. Pure, table-driven. Cost: well under 1 s."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from gpu_resilience_worker.errors import NewerCheckpointError
from gpu_resilience_worker.task_folder import (
    FORMAT, CommitRecord, FileEntry, goodput_file_name, parse_record,
)
from tests.worker.conftest import REPO_ROOT

_A, _B = "a" * 64, "b" * 64
_ROOT_AB = hashlib.sha256(bytes.fromhex(_A) + bytes.fromhex(_B)).hexdigest()
_FILE = {"step": 3, "size": 8192, "chunk_bytes": 4096, "chunks": [_A, _B], "sha256": _ROOT_AB, "created_at": "t"}
_ENTRY = {"path": "checkpoint-3/model.bin", "size": 8192, "chunk_bytes": 4096, "chunks": [_A, _B]}
_FOLDER = {"step": 3, "name": "checkpoint-3", "files": [_ENTRY], "created_at": "t",
           "sha256": hashlib.sha256(bytes.fromhex(_ROOT_AB)).hexdigest()}


def _with(base: dict, **fields) -> bytes:
    return json.dumps({**base, **fields}).encode()


def _entry(**fields) -> bytes:
    return _with(_FOLDER, files=[{**_ENTRY, **fields}])


#: (record bytes, (shape, format) when it parses, else the exception and a part of its message)
RECORDS = {
    "one file, no format (previous release)": (_with(_FILE), ("file", 1)),
    "one file, format 1": (_with(_FILE, format=1), ("file", 1)),
    "one file, crc32 digests": (_with(_FILE, digest="crc32", chunks=["0a0b0c0d", "01020304"],
                                      sha256=hashlib.sha256(bytes.fromhex("0a0b0c0d01020304")).hexdigest()),
                                ("file", 1)),
    "folder, no format (previous release)": (_with(_FOLDER), ("folder", 1)),
    "folder, format 1": (_with(_FOLDER, format=1), ("folder", 1)),
    "folder, the artifact is one file": (
        _with(_FOLDER, name="step-3.ckpt", files=[{**_ENTRY, "path": "step-3.ckpt"}]), ("folder", 1)),
    "format 99: a newer release's": (_with(_FILE, format=99), (NewerCheckpointError, "format 99")),
    "format 2 of a folder: a newer release's": (_with(_FOLDER, format=FORMAT + 1), (NewerCheckpointError, "format 2")),
    "format 99 with nothing else known": (b'{"format": 99, "shards": []}', (NewerCheckpointError, "format 99")),
    "digest blake9: a newer release's": (_with(_FILE, digest="blake9"), (NewerCheckpointError, "digest 'blake9'")),
    "a folder's file with digest blake9": (_entry(digest="blake9"), (NewerCheckpointError, "digest 'blake9'")),
    "format as a string": (_with(_FILE, format="1"), (ValueError, "no valid format")),
    "format 0": (_with(_FILE, format=0), (ValueError, "no valid format")),
    "format true": (_with(_FILE, format=True), (ValueError, "no valid format")),
    "digest not a string": (_with(_FILE, digest=5), (ValueError, "digest must be one of")),
    "torn": (_with(_FILE)[:30], (ValueError, "not valid JSON")),
    "empty": (b"", (ValueError, "not valid JSON")),
    "not an object": (b"[1]", (ValueError, "not a JSON object")),
    "one file without size": (json.dumps({k: v for k, v in _FILE.items() if k != "size"}).encode(),
                              (ValueError, "no valid step or size")),
    "one file, hash list short": (_with(_FILE, chunks=[_A]), (ValueError, "does not cover 8192 bytes")),
    "one file, root digest wrong": (_with(_FILE, sha256=_A), (ValueError, "does not match its hash list")),
    "folder, no files": (_with(_FOLDER, files=[]), (ValueError, "lists no file")),
    "folder, no name": (_with(_FOLDER, name=""), (ValueError, "no valid name")),
    "folder, a name with a slash": (_with(_FOLDER, name="a/b"), (ValueError, "no valid name")),
    "folder, a path out of the folder": (_entry(path="../x"), (ValueError, "outside its checkpoint")),
    "folder, an absolute path": (_entry(path="/etc/passwd"), (ValueError, "outside its checkpoint")),
    "folder, another checkpoint's file": (_entry(path="checkpoint-30/model.bin"), (ValueError, "outside its checkpoint")),
    "folder, a dot in the path": (_entry(path="checkpoint-3/./model.bin"), (ValueError, "outside its checkpoint")),
    "folder, a file listed twice": (_with(_FOLDER, files=[_ENTRY, _ENTRY]), (ValueError, "lists a file twice")),
    "folder, an entry not an object": (_with(_FOLDER, files=["x"]), (ValueError, "outside its checkpoint")),
    "folder, chunk_bytes too small": (_entry(chunk_bytes=1), (ValueError, "chunk_bytes")),
    "folder, root digest wrong": (_with(_FOLDER, sha256=_A), (ValueError, "does not match its hash list")),
}


@pytest.mark.parametrize("raw, outcome", RECORDS.values(), ids=RECORDS.keys())
def test_parse_record(raw: bytes, outcome: tuple) -> None:
    kind, detail = outcome
    if isinstance(kind, str):
        record = parse_record(raw)
        assert ("file" if record.name is None else "folder", record.format) == outcome
        return
    with pytest.raises(kind, match=detail):
        parse_record(raw)


def test_a_newer_record_is_not_a_torn_one() -> None:
    """Callers that skip a ``ValueError`` (a torn record) must not skip a newer release's."""
    assert not issubclass(NewerCheckpointError, ValueError)
    with pytest.raises(NewerCheckpointError) as refused:
        parse_record(_with(_FILE, format=7))
    assert (refused.value.format, refused.value.digest, refused.value.exit_code) == (7, None, 78)


def test_both_shapes_round_trip_and_carry_the_format() -> None:
    one = CommitRecord.of_chunks(3, 8192, [_A, _B], "t", chunk_bytes=4096)
    entry = FileEntry("checkpoint-3/model.bin", 8192, 4096, (_A, _B))
    folder = CommitRecord.of_files(3, "checkpoint-3", [entry], "t")
    for record in (one, folder):
        assert parse_record(record.to_bytes()) == record
        assert json.loads(record.to_bytes())["format"] == FORMAT
    # the one-file record is the previous release's fields plus format; the folder's likewise
    assert json.loads(one.to_bytes()) == {**_FILE, "format": 1}
    assert json.loads(folder.to_bytes()) == {**_FOLDER, "format": 1}
    assert one.size == folder.size == 8192 and one.data.chunks == (_A, _B) and one.data.digest == "sha256"


def test_names() -> None:
    assert goodput_file_name("", 3) == "goodput-local-3.json"
    assert goodput_file_name("job-x", 0) == "goodput-job-x-0.json"


def test_the_schema_module_imports_no_torch() -> None:
    code = "import sys, gpu_resilience_worker.task_folder; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(REPO_ROOT / "worker")}, cwd=REPO_ROOT)
    assert out.stdout.strip() == "False"
