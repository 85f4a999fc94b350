"""Table tests of the log reading in ``scripts/stack_sweep.py``: the triggerer's blocked-event-loop
warnings and the trigger log files' start and event times, on lines in the shapes Airflow 3's
triggerer writes them. Pure file reading."""

from __future__ import annotations

import importlib.util
import json
from datetime import datetime
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "stack_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("stack_sweep_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


_WARNING = ("{stamp} [info     ] Triggerer's async thread was blocked for {seconds} seconds, exceeding the "
            "configured warning threshold of 0.20 seconds. This is likely caused by a badly-written trigger. "
            "[airflow.jobs.triggerer_job_runner] loc=triggerer_job_runner.py:1046")


@pytest.mark.parametrize(("lines", "expected"), [
    ([], []),
    (["2026-12-06T10:36:40.1Z [info     ] Starting the triggerer"], []),
    ([_WARNING.format(stamp="2026-12-06T10:36:44.610803Z", seconds="0.69")],
     [(_epoch("2026-12-06T10:36:44.610803Z"), 0.69)]),
    ([_WARNING.format(stamp="2026-12-06T10:36:44Z", seconds="0.69"), "2026-12-06T10:36:45Z [info     ] 3 triggers",
      _WARNING.format(stamp="2026-12-06T10:37:04.7Z", seconds="12.25")],
     [(_epoch("2026-12-06T10:36:44Z"), 0.69), (_epoch("2026-12-06T10:37:04.7Z"), 12.25)]),
])
def test_blocked_loop_warnings(sweep, lines, expected) -> None:
    assert sweep.blocked_loop_warnings("\n".join(lines)) == expected


def _line(stamp: str, event: str, **extra) -> str:
    return json.dumps({"timestamp": stamp, "level": "info", "event": event, **extra})


@pytest.mark.parametrize(("files", "expected"), [
    ({}, {}),
    # started and fired in one triggerer
    ({"map_index=3/attempt=1.log.trigger.4.log": [
        _line("2026-12-06T10:41:00Z", "trigger d/r/execute_job/3/1 (ID 17) starting"),
        _line("2026-12-06T10:42:03.5Z", "Trigger fired event", name="d/r/execute_job/3/1 (ID 17)"),
        _line("2026-12-06T10:42:03.6Z", "trigger completed", name="d/r/execute_job/3/1 (ID 17)")]},
     {3: {"start": "2026-12-06T10:41:00Z", "fired": "2026-12-06T10:42:03.5Z"}}),
    # started in a triggerer that died, fired in the next one; another still waiting; a stray line
    ({"map_index=0/attempt=1.log.trigger.4.log": [
        _line("2026-12-06T10:41:00Z", "trigger d/r/execute_job/0/1 (ID 2) starting"), "not json"],
      "map_index=0/attempt=1.log.trigger.7.log": [
        _line("2026-12-06T10:41:40Z", "trigger d/r/execute_job/0/1 (ID 2) starting"),
        _line("2026-12-06T10:41:50Z", "Trigger fired event")],
      "map_index=12/attempt=1.log.trigger.7.log": [
        _line("2026-12-06T10:41:41Z", "trigger d/r/execute_job/12/1 (ID 9) starting")]},
     {0: {"start": "2026-12-06T10:41:00Z", "fired": "2026-12-06T10:41:50Z"},
      12: {"start": "2026-12-06T10:41:41Z", "fired": None}}),
])
def test_trigger_times(sweep, tmp_path, files, expected) -> None:
    folder = tmp_path / "dag_id=d" / "run_id=r" / "task_id=execute_job"
    for name, lines in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("\n".join(lines) + "\n")
    # the task's own log beside them is not a trigger log
    (folder / "map_index=3").mkdir(parents=True, exist_ok=True)
    (folder / "map_index=3" / "attempt=1.log").write_text(_line("2026-12-06T10:40:00Z", "Trigger fired event"))
    found = sweep.trigger_times(tmp_path, "d", "r", "execute_job")
    assert found == {index: {key: None if stamp is None else _epoch(stamp) for key, stamp in times.items()}
                     for index, times in expected.items()}


def test_trigger_starts_are_every_trigger_runs_start_of_every_task(sweep, tmp_path) -> None:
    """Mapped or not, every DAG and run, each triggerer's run of a trigger (a restart's too)."""
    files = {"dag_id=d/run_id=r/task_id=execute_job/map_index=0/attempt=1.log.trigger.4.log": [
                 _line("2026-12-06T10:41:00Z", "trigger d/r/execute_job/0/1 (ID 2) starting"), "not json"],
             "dag_id=d/run_id=r/task_id=execute_job/map_index=0/attempt=1.log.trigger.7.log": [
                 _line("2026-12-06T10:41:40Z", "trigger d/r/execute_job/0/1 (ID 2) starting"),
                 _line("2026-12-06T10:41:50Z", "Trigger fired event")],
             "dag_id=e/run_id=s/task_id=execute_job/attempt=2.log.trigger.7.log": [
                 _line("2026-12-06T10:41:41Z", "trigger e/s/execute_job/-1/2 (ID 9) starting")],
             "dag_id=e/run_id=s/task_id=execute_job/attempt=2.log": [
                 _line("2026-12-06T10:40:00Z", "trigger e/s/execute_job/-1/2 (ID 9) starting")]}
    for name, lines in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    expected = ("2026-12-06T10:41:00Z", "2026-12-06T10:41:40Z", "2026-12-06T10:41:41Z")
    assert sweep.trigger_starts(tmp_path) == [_epoch(stamp) for stamp in expected]
