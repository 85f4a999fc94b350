"""No file name in the task namespace is written twice within a second (a real worker process).

Cloud Storage accepts about one mutation per second of one object name. A poller watches every
entry of the namespace while a worker saves a checkpoint on every step, and records each
version of a name: for the small ``*.json`` records, each new content; for other files, a new
inode (a write through a temporary name and a rename) or the same file truncated (a rewrite in
place), while a file growing is one write still streaming. The last
mtimes of consecutive versions of one name must lie at least a second apart (less the file
system's timestamp granularity).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from tests.worker.conftest import SIGTERM, Task

# serial (scripts/run_tests.sh runs it alone): a wall-clock rate (no name written twice a second) and an exit 143 within the grace after SIGTERM.
pytestmark = pytest.mark.serial

#: Every step a checkpoint: about 30 saves a second on this model, each once forcing a
#: progress.json write.
FLAGS = ("--steps", "150", "--batch-size", "64", "--seed", "0",
         "--checkpoint-every", "1", "--step-delay", "0.02")
#: Slack for the coarse (jiffy) timestamps of the file system, in seconds.
GRANULARITY = 0.02


class NamespacePoller:
    """Polls ``folder`` every millisecond or so, recording the versions of every name."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.versions: dict[str, list[tuple[int, int, int]]] = {}  # name -> [(ino, mtime_ns, size)]
        self._contents: dict[str, bytes] = {}  # *.json name -> the content last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> NamespacePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                entries = list(os.scandir(self.folder))
            except FileNotFoundError:
                entries = []
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                version = (info.st_ino, info.st_mtime_ns, info.st_size)
                seen = self.versions.setdefault(entry.name, [])
                if entry.name.endswith(".json"):
                    # small records, replaced whole: a version is a new content (the file system
                    # may give the next replacement the inode number the last one freed)
                    try:  # the content and its times from one open file, never two versions mixed
                        with open(entry.path, "rb") as handle:
                            content = handle.read()
                            opened = os.fstat(handle.fileno())
                    except FileNotFoundError:
                        continue
                    if self._contents.get(entry.name) != content:
                        self._contents[entry.name] = content
                        seen.append((opened.st_ino, opened.st_mtime_ns, opened.st_size))
                    continue
                if seen and seen[-1][0] == info.st_ino and info.st_size >= seen[-1][2]:
                    seen[-1] = version  # the same write still streaming (an upload at close)
                else:
                    seen.append(version)  # a new file, or the old one truncated and rewritten
            time.sleep(0.001)

    def too_close(self) -> dict[str, float]:
        """:return: name -> the shortest gap (seconds) between two of its versions, for every
        name written twice within a second."""
        out = {}
        for name, versions in self.versions.items():
            times = sorted(mtime for _, mtime, _ in versions)
            gaps = [(b - a) / 1e9 for a, b in zip(times, times[1:])]
            if gaps and min(gaps) < 1.0 - GRANULARITY:
                out[name] = round(min(gaps), 4)
        return out


def test_no_name_is_written_twice_a_second_while_saving_every_step(task: Task) -> None:
    with NamespacePoller(task.namespace) as poller:
        process = task.start(flags=FLAGS)
        code = process.wait(timeout=120)
    assert code == 0, process.output[-4000:]
    saved = [r for r in process.records if r.get("message") == "checkpoint saved"]
    assert len(saved) >= 100, "the run must save far more often than once a second"
    assert len(poller.versions.get("progress.json", [])) >= 2, poller.versions.keys()
    assert poller.too_close() == {}
    progress = json.loads((task.namespace / "progress.json").read_text())
    assert (progress["status"], progress["step"]) == ("completed", 150)


def test_preempted_status_is_written_and_not_within_a_second_of_the_last(task: Task) -> None:
    with NamespacePoller(task.namespace) as poller:
        process = task.start(*FLAGS[:-2], "--step-delay", "0.05", flags=(), new_group=True)
        process.wait_for(lambda r: r.get("message") == "checkpoint saved" and r["step"] >= 40, timeout=60)
        process.signal_group(SIGTERM)
        code = process.wait(timeout=30)
    assert code == 143, process.output[-4000:]
    assert poller.too_close() == {}
    progress = json.loads((task.namespace / "progress.json").read_text())
    stop = next(r for r in process.records if r.get("message", "").startswith("SIGTERM received"))
    assert (progress["status"], progress["step"]) == ("preempted", stop["step"])
