"""Several image tables combine (``serve --images A --images B``): each resolves its own paths."""

from __future__ import annotations

import json
from pathlib import Path

from cloud_run_emulator.images import ImageTable


def test_tables_combine_in_order_with_their_own_directories(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "images.json").write_text(json.dumps({"images": {
        "*/worker:*": {"entrypoint": ["w"], "cwd": "."}, "same:1": {"entrypoint": ["from-a"]}}}))
    (b / "images.json").write_text(json.dumps({"images": {
        "*/mine:*": {"entrypoint": ["m"], "cwd": ".", "env": {"PYTHONPATH": "lib"}},
        "same:1": {"entrypoint": ["from-b"]}, "*:*": {"entrypoint": ["any"]}}}))
    table = ImageTable.load([a / "images.json", b / "images.json"])
    assert table.resolve("r/worker:1").cwd == a.resolve()
    mine = table.resolve("r/mine:2")
    assert mine.cwd == b.resolve() and mine.env["PYTHONPATH"] == str((b / "lib").resolve())
    assert table.resolve("same:1").entrypoint == ("from-a",)  # the earlier file wins
    assert table.resolve("r/worker:9").entrypoint == ("w",)  # patterns in file order: a's before b's
    assert table.resolve("other:3").entrypoint == ("any",)
    assert ImageTable.load([]).resolve("r/worker:1") is None
