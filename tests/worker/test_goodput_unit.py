"""The worker's goodput events file (in process, about 1.5 s: it waits out the one-second rule once)."""

from __future__ import annotations

import io
import json
import time

import pytest

from gpu_resilience_worker.attempt import Attempt, process_start_time
from gpu_resilience_worker.config import TaskIdentity
from gpu_resilience_worker.logs import StructuredLogger
from gpu_resilience_worker.storage import LocalStorage
from gpu_resilience_worker.task_folder import goodput_file_name


class CountingStorage(LocalStorage):
    def __init__(self) -> None:
        self.writes: list[tuple[str, float]] = []

    def write(self, path, data, *, atomic=False):
        self.writes.append((path, time.monotonic()))
        super().write(path, data, atomic=atomic)


def _attempt(storage, folder, attempt: int, log=None) -> Attempt:
    return Attempt(storage, str(folder), 100, TaskIdentity(execution="job-abcde", task_attempt=attempt),
                   log or StructuredLogger(io.StringIO()))


def test_events_are_recorded_and_the_file_is_rewritten_at_most_once_a_second(tmp_path):
    storage = CountingStorage()
    (tmp_path / "progress.json").write_text(json.dumps({"step": 47, "total_steps": 100}))
    attempt = _attempt(storage, tmp_path, 2)
    assert attempt.path.endswith(goodput_file_name("job-abcde", 2)) and attempt.path.endswith("goodput-job-abcde-2.json")
    attempt.begin(40, 10.0, 11.5)
    for step in range(41, 241):
        attempt.stepped(step)
    attempt.saved(0.25, saved=True)
    attempt.saved(0.01, saved=False)
    attempt.end(143)
    times = [t for path, t in storage.writes if path.endswith(".json") and "goodput" in path]
    assert len(times) == 2 and times[1] - times[0] >= 1.0  # the restore, then the end after the 1 s
    data = json.loads((tmp_path / "goodput-job-abcde-2.json").read_text())
    assert (data["resumed_from_step"], data["steps_recomputed"], data["steps"], data["saves"]) == (40, 7, 200, 1)
    assert data["step_seconds"] < 0.01 and data["save_blocking_seconds"] == 0.26
    assert (data["status"], data["exit_code"]) == ("preempted", 143) and data["ended_at"] >= data["first_step_at"]
    assert data["process_start"] <= data["first_step_at"]
    attempt.end(0)  # once ended, an attempt stays ended
    assert json.loads((tmp_path / "goodput-job-abcde-2.json").read_text())["status"] == "preempted"


def test_the_end_is_recorded_after_the_wait_just_before_the_last_write(tmp_path):
    """The process ends right after the last write: ``ended_at`` taken before the wait for the
    one-second rule would leave up to a second of the attempt unbilled when its Cloud Run times
    are unknown."""
    attempt = _attempt(CountingStorage(), tmp_path, 1)
    attempt.begin(0, 10.0, 11.5)
    asked = time.time()
    attempt.end(143)
    data = json.loads((tmp_path / "goodput-job-abcde-1.json").read_text())
    assert data["ended_at"] >= asked + 0.9 and data["ended_at"] <= data["updated_at"]


def test_an_attempt_that_fails_before_its_restore_writes_nothing(tmp_path):
    Attempt(LocalStorage(), str(tmp_path), 10, TaskIdentity()).end(1)
    assert list(tmp_path.iterdir()) == []


def test_process_start_is_this_process_start():
    assert time.time() - 3600 < process_start_time() <= time.time()


def test_progress_keeps_the_highest_step_of_every_attempt(tmp_path):
    """An attempt stopped before it got back to an earlier attempt's step must not hide the steps
    that earlier attempt lost: progress.json keeps ``high_water_step``, and the next resume counts
    every step up to it as recomputed (no checkpoint: attempt 1 reaches 20, attempt 2 only 10,
    attempt 3 redoes 20, not 10)."""
    from gpu_resilience_worker.files import PROGRESS, ProgressReporter, highest_reported_step, read_json

    storage, log = LocalStorage(), StructuredLogger(io.StringIO())
    clock = iter(range(0, 10_000, 2)).__next__  # 2 s between writes: never throttled
    assert highest_reported_step({}) is None
    first = ProgressReporter(storage, str(tmp_path), 100, 0, log, clock=clock)
    first.update(20, None)
    assert highest_reported_step(read_json(storage, str(tmp_path / PROGRESS))) == 20
    second = ProgressReporter(storage, str(tmp_path), 100, 0, log, clock=clock, high_water_step=20)
    second.update(10, None)
    record = read_json(storage, str(tmp_path / PROGRESS))
    assert (record["step"], record["high_water_step"]) == (10, 20)
    assert highest_reported_step(record) == 20
    assert highest_reported_step({"step": 7}) == 7  # a file written before the field existed
    assert highest_reported_step({"step": True, "high_water_step": -1}) is None


class FullStorage(LocalStorage):
    """Every write of an advisory file fails with ENOSPC, as on a full disk; counts the tries."""

    def __init__(self) -> None:
        self.tries = 0

    def write(self, path, data, *, atomic=False):
        if path.endswith("attempts.json"):
            return super().write(path, data, atomic=atomic)
        self.tries += 1
        raise OSError(28, "No space left on device", path)


def test_progress_and_goodput_writes_on_a_full_disk_are_logged_once_and_tolerated(tmp_path):
    """``progress.json`` and the goodput events file are advisory: a write that fails (ENOSPC) does
    not raise (it ended the attempt with exit 1 before the third failed save could end it with 74),
    is logged once per file, and still counts for the once-a-second rate (no retry every step)."""
    from gpu_resilience_worker.files import ProgressReporter

    out = io.StringIO()
    log, storage = StructuredLogger(out), FullStorage()
    clock = iter(x * 0.25 for x in range(10_000)).__next__  # 4 calls a second
    progress = ProgressReporter(storage, str(tmp_path), 100, 0, log, clock=clock)
    written = [progress.update(step, 0.5) for step in range(1, 41)]
    assert not any(written) and storage.tries <= 2 + 40 // 4 + 2  # a try a second at most, not one a step
    assert [json.loads(line)["file"].rsplit("/", 1)[-1] for line in out.getvalue().splitlines()
            if json.loads(line)["severity"] == "WARNING"] == ["progress.json"]
    out = io.StringIO()
    attempt = Attempt(storage, str(tmp_path), 100, TaskIdentity(execution="job-x", task_attempt=1), StructuredLogger(out))
    attempt.begin(0, 1.0, 2.0)
    tries = storage.tries
    for step in range(1, 41):
        attempt.stepped(step)
    attempt.end(1)
    assert storage.tries - tries <= 2  # the first progress.json and the end: not one a step
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    warnings = [r for r in records if r["severity"] == "WARNING"]
    assert sorted(r["file"].rsplit("/", 1)[-1] for r in warnings) == ["goodput-job-x-1.json", "progress.json"]
    assert all("No space left on device" in r["error"] for r in warnings)
    assert [p.name for p in tmp_path.iterdir()] == ["attempts.json"]


@pytest.mark.parametrize(("previous", "total", "expected"), [
    ({"step": 30}, 40, 30),
    ({"step": 10**12}, 40, 40),  # a torn or forged progress.json: never more than the run
    ({"step": 10**12}, None, 10**12),  # no total known: as written
    ({"step": 5, "high_water_step": 10**12}, 40, 5),  # only the keys asked for
    ({"step": -3}, 40, None),
    ({"step": "30"}, 40, None),
    ({}, 40, None),
])
def test_a_reported_step_is_bounded_by_the_runs_steps(previous, total, expected):
    from gpu_resilience_worker.files import reported_step

    assert reported_step(previous, total_steps=total) == expected


def test_a_forged_progress_file_loses_at_most_the_steps_left_in_the_run(tmp_path):
    """Resumed from step 30 of 40 with a progress.json claiming step 10**12: 10 steps lost and
    recomputed at most, in attempts.json, the log and the goodput file."""
    (tmp_path / "progress.json").write_text(json.dumps({"step": 10**12, "high_water_step": 10**12, "total_steps": 40}))
    out = io.StringIO()
    attempt = Attempt(LocalStorage(), str(tmp_path), 40, TaskIdentity(execution="job-abcde", task_attempt=1),
                      StructuredLogger(out))
    entry = attempt.begin(30, time.time())
    assert entry["lost_steps"] == 10
    assert json.loads((tmp_path / "attempts.json").read_text())["attempts"][-1]["lost_steps"] == 10
    assert attempt.events["steps_recomputed"] == 10
    assert "lost 10 steps" in out.getvalue() and "999999" not in out.getvalue()


@pytest.mark.parametrize(("since_last", "max_wait", "rest", "slept"), [
    (5.0, -0.5, 0.0, []),  # a second passed: a write may go even with no time to wait
    (0.2, -0.5, 0.8, []),  # within the second, no time to wait: skipped
    (0.2, 0.5, 0.8, []),  # within the second, the rest longer than the wait allowed: skipped
    (0.2, 1.0, 0.0, [0.8]),  # within the second: the rest is slept, then it may go
])
def test_the_one_second_rule_waits_only_as_long_as_allowed(since_last, max_wait, rest, slept):
    from gpu_resilience_worker.files import AdvisoryFile

    sleeps = []
    advisory = AdvisoryFile(LocalStorage(), "unused", None, clock=lambda: 10.0, sleep=sleeps.append)
    advisory.last_write = 10.0 - since_last
    assert advisory.wait_for_rule(max_wait) == pytest.approx(rest)
    assert sleeps == pytest.approx(slept)
