"""ArtifactCheckpoints: the commit protocol around checkpoints a framework writes itself.
Cost: about a second (one child process; no framework imported)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_resilience_worker.artifacts import ArtifactCheckpoints


def _write(folder: Path, step: int, payload: bytes = b"weights") -> None:
    (folder / f"checkpoint-{step}").mkdir(parents=True, exist_ok=True)
    (folder / f"checkpoint-{step}" / "model.bin").write_bytes(payload)
    (folder / f"checkpoint-{step}" / "state.json").write_text(json.dumps({"step": step}))


def test_only_committed_intact_folders_are_resumed_and_kept(tmp_path: Path) -> None:
    store = ArtifactCheckpoints(tmp_path, prefix="checkpoint-", keep_latest_k=2)
    for step in (5, 10, 15):
        store.begin_save(step)
        _write(tmp_path, step)
        store.commit(step)
    assert store.committed_steps() == [15, 10]  # 5 deleted by the keep policy, record first
    assert not (tmp_path / "checkpoint-5").exists() and not (tmp_path / "checkpoint-5.commit.json").exists()
    _write(tmp_path, 20)  # written, never committed (killed before the record)
    assert store.latest().endswith("checkpoint-15")
    (tmp_path / "checkpoint-15" / "model.bin").write_bytes(b"weightz")  # corrupted after the commit
    assert store.verify(15) == (False, "checkpoint-15/model.bin: sha256 of bytes 0-6 does not match the commit record")
    assert store.latest().endswith("checkpoint-10")
    (tmp_path / "checkpoint-10" / "state.json").unlink()  # a file missing
    assert store.latest() is None
    store.cleanup_uncommitted()  # what has no record goes; a record's checkpoint stays for retention to judge
    assert store.present_steps() == [15, 10]
    store.begin_save(25)
    _write(tmp_path, 25)
    store.commit(25)  # retention deletes the one found corrupt, never the one it could not judge
    assert store.present_steps() == [25, 10]


def test_a_stale_record_is_removed_before_the_step_is_rewritten(tmp_path: Path) -> None:
    store = ArtifactCheckpoints(tmp_path, prefix="step-", suffix=".ckpt")
    (tmp_path / "step-7.ckpt").write_bytes(b"old")
    store.commit(7)
    store.begin_save(7)  # an earlier attempt's checkpoint of the same step
    assert not (tmp_path / "step-7.ckpt.commit.json").exists() and not (tmp_path / "step-7.ckpt").exists()
    (tmp_path / "step-7.ckpt").write_bytes(b"new, half")
    assert store.latest() is None


def test_stop_action_after_sigterm(tmp_path: Path) -> None:
    store = ArtifactCheckpoints(tmp_path, prefix="checkpoint-", grace_seconds=10.0)
    assert store.stop_action(3) is None
    store.watcher._handle(signal.SIGTERM, None)
    assert store.stop_action(3) == "save"  # 1 s assumed before any measured save: fits 10 s
    store.last_committed = 3
    assert store.stop_action(3) == "exit"
    store.stats.blocking.append(20.0)  # a measured save longer than the grace
    assert store.stop_action(4) == "exit"
    with pytest.raises(SystemExit) as exc:
        store.exit_preempted(4)
    assert exc.value.code == 143


@pytest.mark.parametrize("kwargs, message", [
    ({"prefix": ""}, "prefix"), ({"prefix": "a/b"}, "prefix"), ({"prefix": "s", "suffix": ".commit.json"}, "suffix"),
    ({"prefix": "s", "keep_latest_k": 1}, "keep_latest_k"), ({"prefix": "s", "grace_seconds": -1}, "grace_seconds"),
])
def test_bad_arguments_are_refused_by_name(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ArtifactCheckpoints(tmp_path, **kwargs)


def test_a_malformed_environment_is_fatal_as_for_the_other_ways_in(tmp_path: Path) -> None:
    """A framework job whose deployment sets ``PREEMPTION_GRACE_SECONDS=soon`` exits 78 with ``FATAL`` naming the
    variable (as the bundled worker and ``ResilientLoop`` do), in a real process: not 1, which Cloud Run retries."""
    folder = tmp_path / "output"
    env = {**os.environ, "PREEMPTION_GRACE_SECONDS": "soon"}
    code = ("from gpu_resilience_worker.artifacts import ArtifactCheckpoints\n"
            f"ArtifactCheckpoints({str(folder)!r}, prefix='checkpoint-')\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 78, done.stderr
    errors = [json.loads(line) for line in done.stdout.splitlines() if '"ERROR"' in line]
    assert len(errors) == 1 and "PREEMPTION_GRACE_SECONDS='soon' is not a number" in errors[0]["message"], errors
    marker = json.loads((folder / "FATAL").read_text())
    assert marker["exit_code"] == 78 and "PREEMPTION_GRACE_SECONDS" in marker["reason"]
    assert sorted(p.name for p in folder.iterdir()) == ["FATAL"]
