"""Reading the worker's progress and lost-work files: a torn or forged claim is bounded (pure)."""

from __future__ import annotations

import logging

import pytest

from airflow_gpu_resilience.hooks.progress import TaskProgress, lost_work_entries, most_lost_steps

LOG = "airflow_gpu_resilience.hooks.progress"


@pytest.fixture
def warned():
    """The messages the module logs at WARNING, caught on its own logger (whatever Airflow's
    logging set-up does with propagation)."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(LOG)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    yield messages
    logger.removeHandler(handler)
    logger.setLevel(level)

#: (progress.json, the step shown or None when the file is refused, whether a warning names step)
PROGRESS = {
    "a running task": ({"step": 40, "total_steps": 100, "status": "running"}, 40, False),
    "done": ({"step": 100, "total_steps": 100}, 100, False),
    "a step of 10**12 in a 100-step run is shown as 100": ({"step": 10**12, "total_steps": 100}, 100, True),
    "one step past the end": ({"step": 101, "total_steps": 100}, 100, True),
    "no total: refused": ({"step": 5}, None, False),
    "a negative step: refused": ({"step": -1, "total_steps": 100}, None, False),
    "a boolean step: refused": ({"step": True, "total_steps": 100}, None, False),
    "not an object": ([1, 2], None, False),
}


@pytest.mark.parametrize("data, shown, warns", PROGRESS.values(), ids=PROGRESS.keys())
def test_progress_step_is_bounded_by_the_runs_steps(data, shown, warns, warned):
    progress = TaskProgress.from_json(3, data, source="gs://b/job/task-3/progress.json")
    assert (None if progress is None else progress.step) == shown
    messages = warned
    if warns:
        assert messages == [f"gs://b/job/task-3/progress.json: step {data['step']} is beyond total_steps 100; "
                            "shown as 100"]
        assert progress.eta_seconds == 0.0 and "(100%)" in progress.describe()
    else:
        assert messages == []


#: (resumed_from_step, total_steps, the most steps that resume can have lost)
MOST = {
    "resumed at 90 of 100": (90, 100, 10),
    "resumed at 0": (0, 100, 100),
    "resumed at the end": (100, 100, 0),
    "resumed past the end (forged)": (10**12, 100, 0),
    "resumed step missing": (None, 100, 100),
    "resumed step not a count": ("90", 100, 100),
    "resumed step negative": (-5, 100, 100),
    "no total known: unbounded": (90, None, None),
}


@pytest.mark.parametrize("resumed, total, most", MOST.values(), ids=MOST.keys())
def test_most_lost_steps(resumed, total, most):
    assert most_lost_steps(resumed, total) == most


def _entry(lost, resumed=90, attempt=1):
    return {"execution": "job-x", "attempt": attempt, "resumed_from_step": resumed, "lost_steps": lost}


#: (file content, total_steps, the lost steps reported per entry, the warnings' count)
LOST = {
    "a progress.json of 10**12 believed by the worker: 10 at most": (
        {"attempts": [_entry(10**12 - 90)]}, 100, [10], 1),
    "within the bound: as written": ({"attempts": [_entry(7)]}, 100, [7], 0),
    "exactly the bound": ({"attempts": [_entry(10)]}, 100, [10], 0),
    "no total known: as written": ({"attempts": [_entry(10**12 - 90)]}, None, [10**12 - 90], 0),
    "resumed past the end: nothing can have been lost, dropped": (
        {"attempts": [_entry(50, resumed=10**12)]}, 100, [], 1),
    "metrics.json's history, several entries": (
        {"history": [_entry(0, 0, 0), _entry(5, 20, 1), _entry(500, 40, 2)]}, 100, [5, 60], 1),
    "not counts: skipped": ({"attempts": [_entry(True), _entry(-3), _entry("9"), "x"]}, 100, [], 0),
    "not an object": (["attempts"], 100, [], 0),
}


@pytest.mark.parametrize("data, total, lost, warnings", LOST.values(), ids=LOST.keys())
def test_lost_steps_are_bounded_by_the_runs_steps(data, total, lost, warnings, warned):
    entries = lost_work_entries(2, data, total, source="gs://b/job/task-2/attempts.json")
    assert [e["lost_steps"] for e in entries] == lost
    assert all(e["task_index"] == 2 and e["execution"] == "job-x" for e in entries)
    assert len(warned) == warnings
    for message in warned:
        assert message.startswith("gs://b/job/task-2/attempts.json: lost_steps ")
        assert "is more than the run's total_steps 100 allows; counted as " in message


def test_the_forged_claim_is_named_in_the_warning(warned):
    lost_work_entries(0, {"attempts": [_entry(999999999910)]}, 100, source="attempts.json")
    assert warned == [("attempts.json: lost_steps 999999999910 of execution job-x attempt 1 (resumed "
                                   "from step 90) is more than the run's total_steps 100 allows; counted as 10")]
