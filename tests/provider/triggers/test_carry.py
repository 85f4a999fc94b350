"""The execute operator's carry (the trigger's ``carry`` and the run state): bounded, and a carry
written by the previous release still resumes."""

from __future__ import annotations

import json

from google.cloud import run_v2

from airflow_gpu_resilience.outcome import Action, AttemptLog, AttemptRecord, Decision, OutcomeClass, TaskOutcome
from airflow_gpu_resilience.run_carry import (
    MAX_ATTEMPTS_PER_TASK,
    MAX_EXECUTIONS_WITH_TASKS,
    bound_attempts,
    compact_executions,
    upgrade,
)
from airflow_gpu_resilience.run_state import RunState
from airflow_gpu_resilience.triggers.cloud_run import CloudRunGpuExecutionTrigger

#: The trigger's serialized kwargs, carry included, as the release before the bounded carry wrote
#: them (a run of two tasks: one execution preempted and re-run, the re-run being waited for).
PREVIOUS_RELEASE_TRIGGER_KWARGS = r"""
{
 "execution": "projects/test-project/locations/us-central1/jobs/job-a/executions/job-a-q7w8e",
 "gcp_conn_id": "google_cloud_default",
 "impersonation_chain": null,
 "transport": null,
 "poll_interval": 10.0,
 "timeout": 3600.0,
 "carry": {
  "project_id": "test-project",
  "run_key": "0123456789abcdef0123456789abcdef",
  "budget": 3,
  "max_reruns_without_progress": 2,
  "max_total_reruns": 48,
  "deadline": 1796000000.0,
  "overall_limit": false,
  "executions": [
   {
    "name": "projects/test-project/locations/us-central1/jobs/job-a/executions/job-a-x1y2z",
    "state": "FAILED",
    "action": "RERUN",
    "reason": "task 1 attempt 2 (signal 15, 'Container instance preemption initiated by the platform due to underlying hardware maintenance.'): preempted; re-run 1 of 3 resumes from the checkpoint",
    "log_uri": "http://127.0.0.1:8123/_emulator/logs/projects/test-project/locations/us-central1/jobs/job-a/executions/job-a-x1y2z",
    "duration_seconds": 1860.0,
    "tasks": [
     {
      "index": 0,
      "attempts": 1,
      "outcome": "SUCCEEDED",
      "exit_code": 0,
      "term_signal": null,
      "status_code": 0,
      "message": "",
      "log_uri": "http://127.0.0.1:8123/_emulator/logs/projects/test-project/locations/us-central1/jobs/job-a/executions/job-a-x1y2z"
     },
     {
      "index": 1,
      "attempts": 2,
      "outcome": "PREEMPTED",
      "exit_code": null,
      "term_signal": 15,
      "status_code": 14,
      "message": "Container instance preemption initiated by the platform due to underlying hardware maintenance.",
      "log_uri": "http://127.0.0.1:8123/_emulator/logs/projects/test-project/locations/us-central1/jobs/job-a/executions/job-a-x1y2z"
     }
    ]
   }
  ],
  "attempts": [
   {
    "task_index": 1,
    "attempt": 0,
    "exit_code": null,
    "term_signal": 15,
    "status_code": 14,
    "message": "Container instance preemption initiated by the platform due to underlying hardware maintenance.",
    "duration_seconds": null,
    "execution": "projects/test-project/locations/us-central1/jobs/job-a/executions/job-a-x1y2z",
    "outcome": "PREEMPTED"
   },
   {
    "task_index": 0,
    "attempt": 0,
    "exit_code": 0,
    "term_signal": null,
    "status_code": 0,
    "message": "",
    "duration_seconds": 1800.0,
    "execution": "projects/test-project/locations/us-central1/jobs/job-a/executions/job-a-x1y2z",
    "outcome": "SUCCEEDED"
   },
   {
    "task_index": 1,
    "attempt": 1,
    "exit_code": null,
    "term_signal": 15,
    "status_code": 14,
    "message": "Container instance preemption initiated by the platform due to underlying hardware maintenance.",
    "duration_seconds": 1800.0,
    "execution": "projects/test-project/locations/us-central1/jobs/job-a/executions/job-a-x1y2z",
    "outcome": "PREEMPTED"
   }
  ],
  "progress": {
   "1": {
    "step": 40,
    "total_steps": 100,
    "status": "running",
    "updated_at": "2026-12-01T10:20:00Z",
    "loss": 0.5,
    "steps_per_second": 10.0
   }
  },
  "classes": {
   "projects/test-project/locations/us-central1/jobs/job-a/executions/job-a-x1y2z": "PREEMPTED"
  }
 },
 "cancel_on_kill": true
}
"""
#: What that release's ``RunState.summary`` made of it (``tasks`` and ``preemptions``).
PREVIOUS_RELEASE_SUMMARY = r"""
{
 "tasks": [
  {
   "index": 0,
   "attempts": 1,
   "exit_codes": [
    0
   ],
   "outcomes": [
    "SUCCEEDED"
   ]
  },
  {
   "index": 1,
   "attempts": 2,
   "exit_codes": [
    -15,
    -15
   ],
   "outcomes": [
    "PREEMPTED",
    "PREEMPTED"
   ]
  }
 ],
 "preemptions": [
  {
   "task_index": 1,
   "attempt": 0,
   "exit_code": null,
   "term_signal": 15,
   "status_code": 14,
   "message": "Container instance preemption initiated by the platform due to underlying hardware maintenance.",
   "duration_seconds": null,
   "execution": "projects/test-project/locations/us-central1/jobs/job-a/executions/job-a-x1y2z",
   "outcome": "PREEMPTED"
  },
  {
   "task_index": 1,
   "attempt": 1,
   "exit_code": null,
   "term_signal": 15,
   "status_code": 14,
   "message": "Container instance preemption initiated by the platform due to underlying hardware maintenance.",
   "duration_seconds": 1800.0,
   "execution": "projects/test-project/locations/us-central1/jobs/job-a/executions/job-a-x1y2z",
   "outcome": "PREEMPTED"
  }
 ]
}
"""
JOB = "projects/test-project/locations/us-central1/jobs/job-a"


def test_a_carry_of_the_previous_release_still_resumes():
    kwargs = json.loads(PREVIOUS_RELEASE_TRIGGER_KWARGS)
    trigger = CloudRunGpuExecutionTrigger(**kwargs)
    assert trigger.serialize()[1] == kwargs  # the triggerer re-creates it from its row unchanged
    run = RunState.from_dict(kwargs["carry"])
    summary = run.summary(JOB, task_count=2, reruns=1, lost_work=[])
    assert {key: summary[key] for key in ("tasks", "preemptions")} == json.loads(PREVIOUS_RELEASE_SUMMARY)
    assert run.task_attempts == {"0": 1, "1": 2} and run.unlisted_attempts == {}
    assert run.executions == kwargs["carry"]["executions"]  # one execution: nothing compacted
    again = json.loads(json.dumps(run.to_dict()))
    assert RunState.from_dict(again) == run


def _execution(name: str, tasks: int, attempts: int) -> tuple:
    """A finished, preempted execution of ``tasks`` tasks with ``attempts`` attempts each."""
    execution = run_v2.Execution(name=name, task_count=tasks, conditions=[run_v2.Condition(
        type_="Completed", state=run_v2.Condition.State.CONDITION_FAILED, message="preempted")])
    outcomes = [TaskOutcome(index=i, attempts=attempts, outcome=OutcomeClass.PREEMPTED, term_signal=15, status_code=14)
                for i in range(tasks)]
    log = AttemptLog(AttemptRecord(i, a, None, 15, 14, "maintenance") for a in range(attempts) for i in range(tasks))
    return execution, outcomes, log


def _grow(run: RunState, executions: int, tasks: int = 20, attempts: int = 3) -> None:
    decision = Decision(Action.RERUN, OutcomeClass.PREEMPTED, "preempted")
    for n in range(len(run.executions), len(run.executions) + executions):
        run.add_execution(*_execution(f"{JOB}/executions/job-a-{n:05d}", tasks, attempts), decision, ())


def _entries(carry: dict) -> int:
    """Attempt and task entries in a carry: what grew with executions x tasks."""
    return len(carry["attempts"]) + sum(len(entry["tasks"]) for entry in carry["executions"])


def test_the_carry_is_bounded_by_the_tasks_not_the_executions():
    run = RunState(project_id="p", run_key="k", budget=3)
    _grow(run, 5)
    after_5 = _entries(run.to_dict())
    _grow(run, 35)
    carry = json.loads(json.dumps(CloudRunGpuExecutionTrigger(execution=f"{JOB}/executions/x", carry=run.to_dict())
                                  .serialize()[1]["carry"]))
    assert _entries(carry) == after_5 == 20 * MAX_ATTEMPTS_PER_TASK + 20 * MAX_EXECUTIONS_WITH_TASKS
    assert [bool(entry["tasks"]) for entry in carry["executions"]] == [False] * 38 + [True] * 2
    assert carry["executions"][0]["task_outcomes"] == {"PREEMPTED": 20}
    summary = RunState.from_dict(carry).summary(JOB, task_count=20, reruns=39, lost_work=[])
    for task in summary["tasks"]:  # the counts stay exact: 40 executions x 3 attempts
        assert task["attempts"] == 120 and len(task["outcomes"]) == MAX_ATTEMPTS_PER_TASK
        assert task["unlisted"] == {"PREEMPTED": 120 - MAX_ATTEMPTS_PER_TASK}
    assert len(summary["preemptions"]) == 20 * MAX_ATTEMPTS_PER_TASK


def _attempt(task: int, outcome: str = "PREEMPTED") -> dict:
    return {"task_index": task, "outcome": outcome}


def test_bound_attempts_keeps_the_newest_per_task_and_in_all():
    attempts = [_attempt(0, "PREEMPTED"), _attempt(1), _attempt(0, "TIMED_OUT"), _attempt(0, "SUCCEEDED"), _attempt(1)]
    unlisted: dict = {}
    assert bound_attempts(attempts, unlisted, per_task=2, total=10) == [attempts[1], attempts[2], attempts[3],
                                                                         attempts[4]]
    assert unlisted == {"0": {"PREEMPTED": 1}}
    assert bound_attempts(attempts, unlisted, per_task=5, total=2) == attempts[3:]
    assert unlisted == {"0": {"PREEMPTED": 2, "TIMED_OUT": 1}, "1": {"PREEMPTED": 1}}


def test_compact_executions_keeps_the_newest_tasks():
    entries = [{"name": str(n), "tasks": [{"outcome": "PREEMPTED"}, {"outcome": "SUCCEEDED"}]} for n in range(3)]
    compact_executions(entries, keep=1)
    assert [(e["tasks"] == [], e.get("task_outcomes")) for e in entries] == [
        (True, {"PREEMPTED": 1, "SUCCEEDED": 1}), (True, {"PREEMPTED": 1, "SUCCEEDED": 1}), (False, None)]


def test_upgrade_is_idempotent_and_copies():
    carry = json.loads(PREVIOUS_RELEASE_TRIGGER_KWARGS)["carry"]
    original = json.dumps(carry, sort_keys=True)
    once = upgrade(carry)
    assert upgrade(once) == once and json.dumps(carry, sort_keys=True) == original
