"""Table test of the progress-aware re-run rule (:func:`~airflow_gpu_resilience.rerun_budget.decide_rerun`).

Each row is a history of executions of one Airflow task instance (oldest first, the one just
finished last), each as ``(newest committed step at its start, at its end)`` for task 0, and
the decision expected for the finished one. Pure: no emulator, well under a second.
"""

from __future__ import annotations

import pytest

from airflow_gpu_resilience.outcome import Action, ExecutionState, OutcomeClass, TaskOutcome, classify_attempt, decide
from airflow_gpu_resilience.rerun_budget import (
    DEFAULT_MAX_TOTAL_RERUNS,
    DEFAULT_MAX_UNKNOWN_PROGRESS,
    ExecutionProgress,
    ProgressBudget,
    decide_rerun,
)

C = OutcomeClass
TIMED_OUT = TaskOutcome(index=0, attempts=2, outcome=C.TIMED_OUT, exit_code=143, status_code=2)
PREEMPTED = TaskOutcome(index=0, attempts=1, outcome=C.PREEMPTED, exit_code=143, status_code=2)


def history(*steps, outcome=C.TIMED_OUT) -> list[ExecutionProgress]:
    """``(start, end)`` pairs (``None``: not recorded; 0: no checkpoint) -> the history."""
    def as_map(step):
        return None if step is None else ({} if step == 0 else {0: step})

    return [ExecutionProgress(f"e{i}", outcome, as_map(a), as_map(b)) for i, (a, b) in enumerate(steps)]


@pytest.mark.parametrize(
    ("steps", "reruns_used", "limit", "total", "action", "reason"),
    [
        # progress in every execution: never counts, however long the chain
        ([(0, 40)], 0, 2, 48, Action.RERUN, "it made progress (task 0: 0 -> 40)"),
        ([(0, 40), (40, 80), (80, 120), (120, 160), (160, 200)], 4, 2, 48, Action.RERUN, "made progress"),
        ([(0, 40)] * 1 + [(40, 40), (40, 80)], 2, 1, 48, Action.RERUN, "made progress"),
        # no progress: the first execution is not a re-run, so two re-runs are allowed after it
        ([(0, 0)], 0, 2, 48, Action.RERUN, "re-run 1 of 2 without progress"),
        ([(0, 0), (0, 0)], 1, 2, 48, Action.RERUN, "re-run 2 of 2 without progress"),
        ([(0, 0), (0, 0), (0, 0)], 2, 2, 48, Action.FAIL_NO_RETRY, "stuck at step 0 (no committed checkpoint yet)"),
        # progress first, then stuck at step 40: two re-runs without progress end it
        ([(0, 40), (40, 40)], 1, 2, 48, Action.RERUN, "re-run 2 of 2 without progress"),
        ([(0, 40), (40, 40), (40, 40)], 2, 2, 48, Action.FAIL_NO_RETRY, "stuck at step 40 (task 0)"),
        # a new checkpoint resets the count
        ([(0, 40), (40, 40), (40, 80), (80, 80)], 3, 2, 48, Action.RERUN, "re-run 2 of 2 without progress"),
        # max_reruns_without_progress=0: the first execution without progress ends it
        ([(0, 0)], 0, 0, 48, Action.FAIL_NO_RETRY, "0 re-run(s) without progress, max_reruns_without_progress=0"),
        ([(0, 40)], 0, 0, 48, Action.RERUN, "made progress"),
        # the total cap stops even a job that makes progress
        ([(0, 40), (40, 80), (80, 120)], 2, 2, 2, Action.FAIL_NO_RETRY, "total re-run cap reached (2 re-runs used, max_total_reruns=2)"),
        # unknown progress (an execution started without the record) neither counts nor resets wrongly
        ([(None, 40)], 0, 2, 48, Action.RERUN, "its progress is unknown"),
        ([(None, 40), (40, 40), (40, 40)], 2, 1, 48, Action.FAIL_NO_RETRY, "stuck at step 40"),
    ],
)
def test_rerun_rule(steps, reruns_used, limit, total, action, reason):
    decision = decide_rerun(TIMED_OUT, reruns_used, ProgressBudget(history(*steps), limit, total))
    assert decision.action is action, decision.reason
    assert reason in decision.reason, decision.reason
    assert decision.outcome is C.TIMED_OUT and decision.blamed is TIMED_OUT


#: The chain of issue 39: progress in every execution (0 -> 63 -> 122 -> 179 -> 230), then one
#: whose end could not be read (the bucket was unreachable at the decision).
PROGRESSING = [(0, 63), (63, 122), (122, 179), (179, 230)]


@pytest.mark.parametrize(
    ("steps", "reruns_used", "unknown", "action", "reason"),
    [
        # an unknown end after progress in every execution: re-run, however many re-runs so far
        (PROGRESSING + [(230, None)], 4, 3, Action.RERUN, "its progress is unknown, which is neither progress"),
        (PROGRESSING + [(230, None)], 4, 0, Action.RERUN, "1 re-run(s) without progress so far"),
        # an unknown execution does not reset the count: the no-progress executions around it add up
        ([(0, 40), (40, 40), (40, None), (None, 40), (40, 40)], 4, 3, Action.FAIL_NO_RETRY,
         "no new committed checkpoint in the last 2 execution(s) (2 re-run(s) without progress"),
        ([(0, 40), (40, 40), (40, None), (None, 40)], 3, 3, Action.RERUN, "1 re-run(s) without progress so far"),
        # nor does it count, up to max_unknown_progress after the last progress
        ([(0, 40), (40, None), (None, None), (None, None)], 3, 3, Action.RERUN, "0 re-run(s) without progress"),
        # beyond it, unknown executions count: a bucket that stays unreadable ends the run in the end
        ([(0, 40), (40, None), (None, None), (None, None)], 3, 1, Action.FAIL_NO_RETRY,
         "2 of them of unknown progress, beyond max_unknown_progress=1): stuck at step 40 (task 0)"),
        ([(0, 40)] + [(None, None)] * 5, 5, 3, Action.FAIL_NO_RETRY, "and that the checkpoint bucket can be read"),
        ([(0, 40)] + [(None, None)] * 4, 4, 3, Action.RERUN, "1 re-run(s) without progress so far"),
        # never any progress known: unknown ones are passed over, the first execution is no re-run
        ([(None, None), (0, 0), (0, 0)], 2, 3, Action.FAIL_NO_RETRY, "stuck at step 0 (no committed checkpoint"),
        ([(None, None)] * 3, 2, 1, Action.FAIL_NO_RETRY, "stuck at an unknown step (the checkpoint bucket could"),
        ([(None, None)] * 3, 2, 2, Action.RERUN, "1 re-run(s) without progress so far"),
        ([(None, None)] * 3, 2, 3, Action.RERUN, "its progress is unknown"),
    ],
)
def test_unknown_progress_is_neither_progress_nor_no_progress(steps, reruns_used, unknown, action, reason):
    """Issue 39 item 1: limit 2 re-runs without progress, at most ``unknown`` executions of unknown
    progress passed over after the last one with progress."""
    budget = ProgressBudget(history(*steps), max_reruns_without_progress=2, max_unknown_progress=unknown)
    decision = decide_rerun(PREEMPTED, reruns_used, budget)
    assert decision.action is action, decision.reason
    assert reason in decision.reason, decision.reason
    assert DEFAULT_MAX_UNKNOWN_PROGRESS == 3  # the execute operator's default max_preemption_reruns


def test_the_stuck_error_names_the_step_the_classes_and_what_to_check():
    steps = history((0, 40), (40, 40), (40, 40), outcome=C.PREEMPTED)
    decision = decide_rerun(PREEMPTED, 2, ProgressBudget(steps, 1))
    assert decision.action is Action.FAIL_NO_RETRY
    assert "no new committed checkpoint in the last 2 execution(s)" in decision.reason
    assert "stuck at step 40 (task 0)" in decision.reason
    assert "their classes: PREEMPTED, PREEMPTED" in decision.reason
    assert "checkpoint interval against the task timeout (TASK_TIMEOUT_SECONDS)" in decision.reason
    assert "time between preemptions" in decision.reason


def test_several_tasks_progress_when_any_task_commits_a_newer_checkpoint():
    moving = ExecutionProgress("e", C.TIMED_OUT, {0: 40, 1: 40}, {0: 40, 1: 50})
    stuck = ExecutionProgress("e", C.TIMED_OUT, {0: 40, 1: 50}, {0: 40, 1: 50})
    assert moving.made_progress and stuck.made_progress is False
    decision = decide_rerun(TIMED_OUT, 3, ProgressBudget([moving, stuck, stuck], 2))
    assert decision.action is Action.FAIL_NO_RETRY and "task 0: step 40, task 1: step 50" in decision.reason


def test_decide_uses_the_fixed_budget_without_progress_and_the_rule_with_it():
    """Without checkpoint steps ``max_reruns`` decides; with them it does not."""
    tasks = [TIMED_OUT]
    fixed = decide(tasks, state=ExecutionState.FAILED, reruns_used=3, max_reruns=3)
    assert fixed.action is Action.FAIL_NO_RETRY and "preemption budget exhausted (3 re-runs used)" in fixed.reason
    steps = history((0, 40), (40, 80), (80, 120), (120, 160))
    ruled = decide(tasks, state=ExecutionState.FAILED, reruns_used=3, max_reruns=3, progress=ProgressBudget(steps))
    assert ruled.action is Action.RERUN and "at most 48 in total" in ruled.reason
    assert DEFAULT_MAX_TOTAL_RERUNS >= 24  # a day of one-hour executions


@pytest.mark.parametrize(
    ("exit_code", "signal", "code", "message", "duration", "timeout", "expected"),
    [
        # the worker's own exit 143 just before the task timeout (TASK_TIMEOUT_SECONDS): TIMED_OUT
        (143, None, 2, "The container exited with an error.", 11.0, 20.0, C.TIMED_OUT),
        (143, None, 2, "The container exited with an error.", 3585.0, 3600.0, C.TIMED_OUT),
        # the same exit long before it, or with a maintenance message, or by signal: PREEMPTED
        (143, None, 2, "The container exited with an error.", 600.0, 3600.0, C.PREEMPTED),
        (143, None, 14, "preemption due to hardware maintenance", 3590.0, 3600.0, C.PREEMPTED),
        (None, 15, 2, "", 3590.0, 3600.0, C.PREEMPTED),
        (143, None, 2, "The container exited with an error.", None, 20.0, C.PREEMPTED),
        (143, None, 2, "The container exited with an error.", 11.0, None, C.PREEMPTED),
        # other exits stay what they were
        (1, None, 2, "The container exited with an error.", 19.0, 20.0, C.FAILED),
        (0, None, 0, "", 19.0, 20.0, C.SUCCEEDED),
    ],
)
def test_a_deadline_stop_is_timed_out(exit_code, signal, code, message, duration, timeout, expected):
    got = classify_attempt(exit_code=exit_code, term_signal=signal, status_code=code, message=message,
                           duration_seconds=duration, timeout_seconds=timeout)
    assert got is expected
