"""Clean-up never follows a symlink out of the namespace, and an oversized commit record is an
invalid record that is never read whole."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

from tests.worker.test_checkpoint_unit import Box, ListLog, _manager


def _stale_files(folder: Path) -> list[str]:
    (folder / "ckpt-00000007.pt").write_bytes(b"uncommitted")
    (folder / "ckpt-00000003.commit.json.tmp").write_bytes(b"{")
    return ["ckpt-00000003.commit.json.tmp", "ckpt-00000007.pt"]


def test_cleanup_does_not_delete_through_a_symlinked_namespace(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    stale = _stale_files(target)
    namespace = tmp_path / "task-0"
    namespace.symlink_to(target, target_is_directory=True)
    log = ListLog()
    box = Box()
    with _manager(namespace, box, log) as manager:
        for step in (10, 20, 30):  # three commits with keep 2: the oldest would be purged
            box.tensor += 1
            assert manager.save(step)
    names = sorted(p.name for p in target.iterdir())
    assert set(stale) <= set(names), names
    assert "ckpt-00000010.pt" in names and "ckpt-00000010.commit.json" in names
    assert not any(r.get("message") == "removed stale checkpoint file" for r in log.records)
    assert any("symlink" in r.get("message", "") for r in log.records if r["severity"] == "WARNING")


def test_cleanup_does_not_delete_below_a_symlinked_parent_folder(tmp_path: Path) -> None:
    """``{root}/{job}`` a link to elsewhere: the namespace ``{job}/task-0`` is a real folder in
    the target, and nothing in it is deleted."""
    target = tmp_path / "elsewhere"
    (target / "task-0").mkdir(parents=True)
    stale = _stale_files(target / "task-0")
    (tmp_path / "job").symlink_to(target, target_is_directory=True)
    namespace = tmp_path / "job" / "task-0"
    log = ListLog()
    box = Box()
    with _manager(namespace, box, log) as manager:
        for step in (10, 20, 30):
            box.tensor += 1
            assert manager.save(step)
    names = sorted(p.name for p in (target / "task-0").iterdir())
    assert set(stale) <= set(names), names
    assert "ckpt-00000010.pt" in names
    assert any("symlink" in r.get("message", "") for r in log.records if r["severity"] == "WARNING")


def test_cleanup_skips_symlinked_entries(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    victims = [outside / "a.pt", outside / "b.tmp"]
    for victim in victims:
        victim.write_bytes(b"precious")
    namespace = tmp_path / "task-0"
    namespace.mkdir()
    (namespace / "ckpt-00000007.pt").symlink_to(victims[0])  # stale: no commit record
    (namespace / "ckpt-00000004.pt.tmp").symlink_to(victims[1])
    (namespace / "ckpt-00000005.pt").write_bytes(b"uncommitted")  # a real stale file
    box = Box()
    with _manager(namespace, box) as manager:
        assert manager.save(10)
    assert (namespace / "ckpt-00000007.pt").is_symlink() and (namespace / "ckpt-00000004.pt.tmp").is_symlink()
    assert all(v.read_bytes() == b"precious" for v in victims)
    assert not (namespace / "ckpt-00000005.pt").exists()


def test_an_oversized_commit_record_is_invalid_and_not_read_whole(tmp_path: Path) -> None:
    box = Box(1.0)
    with _manager(tmp_path, box) as manager:
        assert manager.save(10)
    (tmp_path / "ckpt-00000020.pt").write_bytes((tmp_path / "ckpt-00000010.pt").read_bytes())
    with open(tmp_path / "ckpt-00000020.commit.json", "wb") as handle:
        handle.truncate(256 << 20)  # 256 MiB, sparse
    log = ListLog()
    with _manager(tmp_path, Box(), log) as manager:
        tracemalloc.start()
        try:
            ok, reason = manager.verify(20)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 32 << 20, f"{peak} bytes allocated to reject the record"
        assert not ok and "larger than" in reason, reason
        restored = Box()
    with _manager(tmp_path, restored, log) as manager:
        assert manager.latest_step() == 10
        assert manager.load() and manager.loaded_step == 10
    assert os.path.getsize(tmp_path / "ckpt-00000020.commit.json") == 256 << 20
