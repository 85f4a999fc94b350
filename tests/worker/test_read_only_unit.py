"""A read-only look at a checkpoint folder deletes nothing; the first save cleans up."""

from __future__ import annotations

from pathlib import Path

from tests.worker.test_checkpoint_unit import Box, ListLog, _manager


def _folder_with_leftovers(folder: Path) -> list[str]:
    box = Box(1.0)
    with _manager(folder, box) as manager:
        assert manager.save(10)
    (folder / "ckpt-00000020.pt").write_bytes(b"uncommitted")  # a killed save's data
    (folder / "ckpt-00000020.commit.json.tmp").write_bytes(b"{")
    (folder / "ckpt-00000030.pt.tmp").write_bytes(b"half")
    return sorted(p.name for p in folder.iterdir())


def test_constructing_a_manager_and_asking_what_is_there_deletes_nothing(tmp_path: Path) -> None:
    before = _folder_with_leftovers(tmp_path)
    restored = Box()
    with _manager(tmp_path, restored) as manager:
        assert manager.latest_step() == 10
        assert manager.valid_steps() == [10]
        assert manager.verify(20)[0] is False
        assert manager.present_steps() == [20, 10]
        assert manager.load() and manager.loaded_step == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_first_save_removes_what_a_killed_attempt_left(tmp_path: Path) -> None:
    _folder_with_leftovers(tmp_path)
    log = ListLog()
    box = Box()
    with _manager(tmp_path, box, log) as manager:
        assert manager.load()
        assert manager.save(20)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000010.commit.json", "ckpt-00000010.pt", "ckpt-00000020.commit.json", "ckpt-00000020.pt",
    ]
    removed = [r["file"] for r in log.records if r.get("message") == "removed stale checkpoint file"]
    assert removed == ["ckpt-00000020.commit.json.tmp", "ckpt-00000020.pt", "ckpt-00000030.pt.tmp"]
