"""Table tests: every row of the outcome table (docs/howto/execute-job.rst), plus task and execution classification."""

from __future__ import annotations

import datetime as dt

import pytest
from google.cloud import run_v2
from google.rpc import status_pb2

from airflow_gpu_resilience.outcome import (
    AttemptLog,
    AttemptRecord,
    observe_attempts,
    worker_attempt,
    Action,
    ExecutionState,
    OutcomeClass,
    TaskOutcome,
    classify_attempt,
    classify_attempt_result,
    classify_task,
    decide,
    execution_state,
    wants_worker_reason,
    with_worker_reason,
)

MAINTENANCE = "Container instance preemption initiated by the platform due to underlying hardware maintenance."
ERROR = "The container exited with an error."
C = OutcomeClass


@pytest.mark.parametrize(
    ("exit_code", "signal", "code", "message", "expected"),
    [
        # SUCCEEDED
        (0, None, 0, "", C.SUCCEEDED),
        # PREEMPTED: exit 143 (worker trapped SIGTERM), 137 (SIGKILL via a shell)
        (143, None, 2, ERROR, C.PREEMPTED),
        (137, None, 2, ERROR, C.PREEMPTED),
        (143, None, 14, MAINTENANCE, C.PREEMPTED),
        # PREEMPTED: signal-only results (no exit code), killed by the system
        (None, 15, 2, "", C.PREEMPTED),
        (None, 9, 2, "", C.PREEMPTED),
        (None, 15, 14, MAINTENANCE, C.PREEMPTED),
        (None, 9, 14, MAINTENANCE, C.PREEMPTED),
        # PREEMPTED: only the maintenance message (exit code unset)
        (None, None, 14, MAINTENANCE, C.PREEMPTED),
        (1, None, 14, MAINTENANCE, C.PREEMPTED),
        # TIMED_OUT: task timeout, by status code or message
        (None, 15, 4, "Task attempt exceeded its timeout of 600s.", C.TIMED_OUT),
        (143, None, 4, "", C.TIMED_OUT),
        (None, 9, 2, "The task timed out.", C.TIMED_OUT),
        # FAILED: application error, out of memory (even with SIGKILL/137)
        (1, None, 2, ERROR, C.FAILED),
        (2, None, 2, ERROR, C.FAILED),
        (255, None, 2, ERROR, C.FAILED),
        (None, 9, 2, "Memory limit of 16384 MiB exceeded with 16500 MiB used.", C.FAILED),
        (137, None, 2, "Container terminated: out of memory (OOMKilled)", C.FAILED),
        (None, None, 13, "Internal error starting the container", C.FAILED),
        (None, 6, 2, "", C.FAILED),  # SIGABRT: a crash, not the platform
        # FATAL: sysexits 64-78
        (64, None, 2, ERROR, C.FATAL),
        (65, None, 2, ERROR, C.FATAL),
        (78, None, 2, ERROR, C.FATAL),
        (79, None, 2, ERROR, C.FAILED),
        (63, None, 2, ERROR, C.FAILED),
        # CANCELLED status without a preemption trace
        (None, None, 1, "Cancelled by user", C.CANCELLED),
        # CANCELLED although the stop left a preemption trace (SIGTERM: exit 143 or signal 15)
        (143, None, 1, "The task was cancelled.", C.CANCELLED),
        (None, 15, 1, "The task was cancelled.", C.CANCELLED),
        (None, 9, 1, "The task was cancelled.", C.CANCELLED),
        # ... unless the message names a maintenance preemption
        (143, None, 1, MAINTENANCE, C.PREEMPTED),
    ],
)
def test_classify_attempt(exit_code, signal, code, message, expected):
    assert classify_attempt(exit_code=exit_code, term_signal=signal, status_code=code, message=message) is expected


def test_fatal_exit_codes_are_configurable():
    kwargs = {"exit_code": 3, "term_signal": None, "status_code": 2, "message": ERROR}
    assert classify_attempt(**kwargs) is C.FAILED
    assert classify_attempt(**kwargs, fatal_exit_codes={3}) is C.FATAL
    assert classify_attempt(**{**kwargs, "exit_code": 78}, fatal_exit_codes={3}) is C.FAILED


def _result(exit_code=0, signal=0, code=0, message=""):
    return run_v2.TaskAttemptResult(
        status=status_pb2.Status(code=code, message=message), exit_code=exit_code, term_signal=signal
    )


def test_classify_attempt_result_signal_wins_over_default_exit_code():
    assert classify_attempt_result(_result(signal=15, code=14, message=MAINTENANCE)) is C.PREEMPTED
    assert classify_attempt_result(_result(exit_code=0, code=0)) is C.SUCCEEDED
    assert classify_attempt_result(_result(exit_code=65, code=2)) is C.FATAL


def _condition(state, reason=None):
    cond = run_v2.Condition(type_="Completed", state=state)
    if reason is not None:
        cond.execution_reason = reason
    return cond


S = run_v2.Condition.State
R = run_v2.Condition.ExecutionReason
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def _task(index=0, retried=0, result=None, state=S.CONDITION_SUCCEEDED, reason=None, done=True):
    task = run_v2.Task(index=index, retried=retried, log_uri="https://log/x", conditions=[_condition(state, reason)])
    if result is not None:
        task.last_attempt_result = result
        task.start_time = NOW
    if done:
        task.completion_time = NOW
    return task


class TestClassifyTask:
    def test_succeeded(self):
        out = classify_task(_task(result=_result(0)))
        assert out == TaskOutcome(0, 1, C.SUCCEEDED, 0, None, 0, "", "https://log/x")

    def test_preempted_after_retries(self):
        out = classify_task(_task(index=2, retried=3, result=_result(signal=9, code=14, message=MAINTENANCE), state=S.CONDITION_FAILED))
        assert (out.index, out.attempts, out.outcome, out.exit_code, out.term_signal) == (2, 4, C.PREEMPTED, None, 9)

    def test_running(self):
        task = _task(result=_result(143, code=2), state=S.CONDITION_RECONCILING, done=False)
        assert classify_task(task).outcome is C.RUNNING

    def test_pending_without_conditions(self):
        assert classify_task(run_v2.Task(index=1)).outcome is C.RUNNING

    def test_cancelled_by_condition(self):
        task = _task(result=_result(143, code=2), state=S.CONDITION_FAILED, reason=R.CANCELLED)
        assert classify_task(task).outcome is C.CANCELLED

    def test_never_ran_is_incomplete(self):
        out = classify_task(_task(state=S.CONDITION_FAILED))
        assert (out.outcome, out.attempts, out.exit_code) == (C.INCOMPLETE, 0, None)

    def test_to_dict_is_json_able(self):
        import json

        assert json.loads(json.dumps(classify_task(_task(result=_result(0))).to_dict()))["outcome"] == "SUCCEEDED"


def _execution(task_count=1, succeeded=0, failed=0, cancelled=0, state=S.CONDITION_SUCCEEDED, reason=None, done=True):
    ex = run_v2.Execution(
        task_count=task_count, succeeded_count=succeeded, failed_count=failed, cancelled_count=cancelled,
        conditions=[_condition(state, reason)],
    )
    if done:
        ex.completion_time = NOW
    return ex


@pytest.mark.parametrize(
    ("execution", "expected"),
    [
        (_execution(succeeded=1), ExecutionState.SUCCEEDED),
        (_execution(failed=1, state=S.CONDITION_FAILED, reason=R.NON_ZERO_EXIT_CODE), ExecutionState.FAILED),
        (_execution(cancelled=1, state=S.CONDITION_FAILED, reason=R.CANCELLED), ExecutionState.CANCELLED),
        (_execution(state=S.CONDITION_FAILED, reason=R.CANCELLING), ExecutionState.CANCELLED),
        (_execution(state=S.CONDITION_RECONCILING, done=False), ExecutionState.RUNNING),
        (_execution(state=S.CONDITION_PENDING, done=False), ExecutionState.RUNNING),
        (run_v2.Execution(task_count=1), ExecutionState.RUNNING),
        (_execution(task_count=2, failed=1, cancelled=1, state=S.CONDITION_FAILED, reason=R.NON_ZERO_EXIT_CODE), ExecutionState.FAILED),
    ],
)
def test_execution_state(execution, expected):
    assert execution_state(execution) is expected


def t(index, outcome, exit_code=None, signal=None):
    return TaskOutcome(index=index, attempts=1, outcome=outcome, exit_code=exit_code, term_signal=signal)


@pytest.mark.parametrize(
    ("tasks", "state", "used", "action", "outcome", "reason"),
    [
        ([t(0, C.SUCCEEDED, 0)], ExecutionState.SUCCEEDED, 0, Action.SUCCEED, C.SUCCEEDED, "all tasks succeeded"),
        ([t(0, C.PREEMPTED, 143)], ExecutionState.FAILED, 0, Action.RERUN, C.PREEMPTED, "re-run 1 of 3"),
        ([t(0, C.PREEMPTED, None, 15)], ExecutionState.FAILED, 2, Action.RERUN, C.PREEMPTED, "signal 15"),
        ([t(0, C.PREEMPTED, 143)], ExecutionState.FAILED, 3, Action.FAIL_NO_RETRY, C.PREEMPTED, "preemption budget exhausted"),
        ([t(0, C.TIMED_OUT, 143)], ExecutionState.FAILED, 0, Action.RERUN, C.TIMED_OUT, "timed out"),
        ([t(0, C.FAILED, 1)], ExecutionState.FAILED, 0, Action.FAIL, C.FAILED, "exit code 1"),
        ([t(0, C.FATAL, 78)], ExecutionState.FAILED, 0, Action.FAIL_NO_RETRY, C.FATAL, "non-retryable exit code"),
        ([t(0, C.PREEMPTED, 143)], ExecutionState.CANCELLED, 0, Action.FAIL_NO_RETRY, C.CANCELLED, "cancelled"),
        # Mixed: FATAL beats FAILED beats PREEMPTED; system-cancelled siblings do not count.
        ([t(0, C.PREEMPTED, 143), t(1, C.FAILED, 1)], ExecutionState.FAILED, 0, Action.FAIL, C.FAILED, "task 1"),
        ([t(0, C.FAILED, 1), t(1, C.FATAL, 65)], ExecutionState.FAILED, 0, Action.FAIL_NO_RETRY, C.FATAL, "task 1"),
        ([t(0, C.SUCCEEDED, 0), t(1, C.PREEMPTED, 143), t(2, C.CANCELLED)], ExecutionState.FAILED, 0, Action.RERUN, C.PREEMPTED, "task 1"),
        ([t(0, C.SUCCEEDED, 0), t(1, C.INCOMPLETE)], ExecutionState.FAILED, 0, Action.FAIL, C.FAILED, "without a task to blame"),
        ([t(0, C.PREEMPTED, 143)], ExecutionState.FAILED, 0, Action.RERUN, C.PREEMPTED, "resumes from the checkpoint"),
    ],
)
def test_decide(tasks, state, used, action, outcome, reason):
    decision = decide(tasks, state=state, reruns_used=used, max_reruns=3)
    assert (decision.action, decision.outcome) == (action, outcome)
    assert reason in decision.reason


def test_decide_zero_budget_fails_on_first_preemption():
    decision = decide([t(0, C.PREEMPTED, 143)], state=ExecutionState.FAILED, reruns_used=0, max_reruns=0)
    assert decision.action is Action.FAIL_NO_RETRY and "budget exhausted" in decision.reason


#: The worker's marker of a newer release's commit record (docs/worker-contract.rst, ``FATAL``), and its reason.
NEWER_REASON = ("commit record /ckpt/job/task-0/ckpt-00000120.commit.json has format 99 (this release reads formats up "
                "to 1): a newer release of the worker wrote it (was the image rolled back?); nothing was resumed or deleted")
NEWER_MARKER = {"exit_code": 78, "reason": NEWER_REASON, "created_at": "2026-01-01T00:00:00Z", "invocation": None,
                "newer_record": {"file": "/ckpt/job/task-0/ckpt-00000120.commit.json", "format": 99, "digest": None}}
BAD_FLAG = {"exit_code": 78, "reason": "--lr must be a finite number > 0, got inf", "invocation": None}
DIVERGED = {"exit_code": 70, "reason": "training diverged at step 12: loss is nan"}
FOLDER = "commit record ckpt-00000120.commit.json has format 99, written by a newer worker release"


@pytest.mark.parametrize(
    ("task", "marker", "newer", "outcome", "reason"),
    [
        # a refusal of a newer release's record: FATAL, also when fatal_exit_codes left 78 out (FAILED)
        (t(0, C.FATAL, 78), NEWER_MARKER, None, C.FATAL, NEWER_REASON),
        (t(0, C.FAILED, 78), NEWER_MARKER, None, C.FATAL, NEWER_REASON),
        (t(0, C.FAILED, 78), NEWER_MARKER, FOLDER, C.FATAL, NEWER_REASON),  # the worker's words first
        (t(0, C.FAILED, 78), None, FOLDER, C.FATAL, FOLDER),  # no marker: the provider's reading of the folder
        (t(0, C.FAILED, 78), DIVERGED, FOLDER, C.FATAL, FOLDER),  # a marker of another exit code does not apply
        (t(0, C.FAILED, 78), BAD_FLAG, FOLDER, C.FATAL, BAD_FLAG["reason"]),
        # any other marker: its reason, the class that fatal_exit_codes gave
        (t(0, C.FATAL, 78), BAD_FLAG, None, C.FATAL, BAD_FLAG["reason"]),
        (t(0, C.FAILED, 78), BAD_FLAG, None, C.FAILED, BAD_FLAG["reason"]),
        (t(0, C.FATAL, 70), DIVERGED, None, C.FATAL, DIVERGED["reason"]),
        (t(0, C.FAILED, 70), DIVERGED, FOLDER, C.FAILED, DIVERGED["reason"]),  # a newer record matters for 78 only
        # no marker that applies: unchanged
        (t(0, C.FATAL, 65), DIVERGED, None, C.FATAL, ""),
        (t(0, C.FATAL, 78), None, None, C.FATAL, ""),
        (t(0, C.FATAL, 78), "not a marker", None, C.FATAL, ""),
        (t(0, C.FATAL, 78), {"exit_code": "78", "reason": "x"}, None, C.FATAL, ""),
        (t(0, C.FATAL, 78), {"exit_code": True, "reason": "x"}, None, C.FATAL, ""),
        (t(0, C.FATAL, 78), {"exit_code": 78, "reason": "  "}, None, C.FATAL, ""),
        (t(0, C.FATAL, 78), {"exit_code": 78, "reason": ["x"]}, None, C.FATAL, ""),
        # not a worker's non-retryable stop: never read, never changed
        (t(0, C.PREEMPTED, 143), NEWER_MARKER, FOLDER, C.PREEMPTED, ""),
        (t(0, C.SUCCEEDED, 0), NEWER_MARKER, FOLDER, C.SUCCEEDED, ""),
        (t(0, C.FAILED, 1), {**NEWER_MARKER, "exit_code": 1}, FOLDER, C.FAILED, ""),
        (t(0, C.FAILED, None, 9), NEWER_MARKER, FOLDER, C.FAILED, ""),
        (t(0, C.CANCELLED, 78), NEWER_MARKER, FOLDER, C.CANCELLED, ""),
        (t(0, C.FATAL, 79), {"exit_code": 79, "reason": "x"}, None, C.FATAL, ""),  # a user's code, not the worker's
    ],
)
def test_with_worker_reason(task, marker, newer, outcome, reason):
    explained = with_worker_reason(task, marker, newer)
    assert (explained.outcome, explained.reason) == (outcome, reason)
    assert explained.exit_code == task.exit_code and explained.index == task.index
    assert wants_worker_reason(task) is (task.outcome in (C.FATAL, C.FAILED) and task.exit_code in range(64, 79))


def test_a_worker_reason_is_bounded_and_travels_in_the_dict_form_only_when_there_is_one():
    explained = with_worker_reason(t(0, C.FATAL, 78), {"exit_code": 78, "reason": "x" * 5000})
    assert len(explained.reason) == 1000 and explained.reason.endswith("...")
    assert explained.to_dict()["reason"] == explained.reason
    assert "reason" not in t(0, C.FATAL, 78).to_dict()


@pytest.mark.parametrize(
    ("tasks", "action", "outcome", "reason"),
    [
        ([t(0, C.FATAL, 78)], Action.FAIL_NO_RETRY, C.FATAL, "task 0 attempt 1 (exit code 78): non-retryable exit code"),
        ([with_worker_reason(t(0, C.FAILED, 78), NEWER_MARKER)], Action.FAIL_NO_RETRY, C.FATAL,
         f"task 0 attempt 1 (exit code 78): {NEWER_REASON}"),
        ([t(0, C.FAILED, 1), with_worker_reason(t(1, C.FAILED, 78), None, FOLDER)], Action.FAIL_NO_RETRY, C.FATAL,
         f"task 1 attempt 1 (exit code 78): {FOLDER}"),
        ([with_worker_reason(t(0, C.FAILED, 70), DIVERGED)], Action.FAIL, C.FAILED,
         f"task 0 attempt 1 (exit code 70): failed after its retries; the worker says: {DIVERGED['reason']}"),
    ],
)
def test_decide_gives_the_workers_reason(tasks, action, outcome, reason):
    decision = decide(tasks, state=ExecutionState.FAILED, reruns_used=0, max_reruns=3)
    assert (decision.action, decision.outcome, decision.reason) == (action, outcome, reason)


def test_decide_refuses_running_execution():
    with pytest.raises(ValueError, match="RUNNING"):
        decide([], state=ExecutionState.RUNNING, reruns_used=0, max_reruns=3)


class TestObserveAttempts:
    def test_running_retry_reports_previous_attempt(self):
        running = _task(index=0, retried=1, result=_result(signal=15, code=14, message=MAINTENANCE),
                        state=S.CONDITION_RECONCILING, done=False)
        [record] = observe_attempts([running])
        assert (record.task_index, record.attempt, record.term_signal, record.exit_code) == (0, 0, 15, None)
        assert record.classify() is C.PREEMPTED

    def test_finished_task_reports_last_attempt_and_skips_seen(self):
        done = _task(index=1, retried=2, result=_result(exit_code=0))
        assert [r.key for r in observe_attempts([done], seen={(1, 0), (1, 1)})] == [(1, 2)]
        assert observe_attempts([done], seen={(1, 0), (1, 1), (1, 2)}) == []

    def test_pending_first_attempt_and_no_result_are_skipped(self):
        pending = _task(index=0, retried=0, result=_result(143, code=2), state=S.CONDITION_PENDING, done=False)
        assert observe_attempts([pending, run_v2.Task(index=1)]) == []

    @pytest.mark.parametrize(
        "retried, running, seen, keys, unobserved",
        [
            # a finished task at attempt 2 seen for the first time: 0 and 1 ended unseen
            (2, False, set(), [(0, 0), (0, 1), (0, 2)], [(0, 0), (0, 1)]),
            # attempt 0 was seen by an earlier poll, attempt 1 was not
            (2, False, {(0, 0)}, [(0, 1), (0, 2)], [(0, 1)]),
            # every earlier attempt seen: only the visible one is new
            (2, False, {(0, 0), (0, 1)}, [(0, 2)], []),
            # attempt 3 running: the visible result is attempt 2's, 0 and 1 unseen
            (3, True, set(), [(0, 0), (0, 1), (0, 2)], [(0, 0), (0, 1)]),
            # nothing retried: nothing can be missed
            (0, False, set(), [(0, 0)], []),
        ],
    )
    def test_attempts_no_poll_saw_are_recorded_once_as_unobserved(self, retried, running, seen, keys, unobserved):
        task = _task(index=0, retried=retried, result=_result(exit_code=0 if not running else 143, code=0 if not running else 14,
                                                                message="" if not running else MAINTENANCE),
                     state=S.CONDITION_RECONCILING if running else S.CONDITION_SUCCEEDED, done=not running)
        records = observe_attempts([task], seen=seen)
        assert [r.key for r in records] == keys
        assert [r.key for r in records if r.classify() is C.UNOBSERVED] == unobserved
        for record in records:
            if not record.observed:
                assert (record.exit_code, record.term_signal) == (None, None)
                assert AttemptRecord.from_dict(record.to_dict()) == record

    def test_attempt_log_records_an_unobserved_attempt_once(self):
        log = AttemptLog()
        running = _task(index=0, retried=2, result=_result(signal=15, code=14, message=MAINTENANCE),
                        state=S.CONDITION_RECONCILING, done=False)
        done = _task(index=0, retried=2, result=_result(exit_code=0))
        assert [(r.key, r.classify()) for r in log.observe([running])] == [((0, 0), C.UNOBSERVED), ((0, 1), C.PREEMPTED)]
        assert [(r.key, r.classify()) for r in log.observe([done])] == [((0, 2), C.SUCCEEDED)]
        assert log.observe([done]) == []
        assert [r.classify() for r in AttemptLog.from_dicts(log.to_dicts()).records] == [C.UNOBSERVED, C.PREEMPTED, C.SUCCEEDED]

    def test_a_record_from_before_the_observed_field_reads_as_observed(self):
        data = AttemptRecord(0, 0, 143, None, 14, MAINTENANCE).to_dict()
        del data["observed"]
        assert AttemptRecord.from_dict(data).classify() is C.PREEMPTED

    def test_round_trip(self):
        record = AttemptRecord(0, 1, 143, None, 2, ERROR)
        assert AttemptRecord.from_dict(record.to_dict()) == record
        assert record.classify(fatal_exit_codes={143}) is C.FATAL


# --- an attempt no poll saw, from the worker's goodput events file ---------------------------
WORKER_EVENTS = {"status": "preempted", "exit_code": 143, "process_start": 1000.0, "ended_at": 1040.5}


@pytest.mark.parametrize(
    ("events", "timeout", "expected", "duration"),
    [
        (WORKER_EVENTS, None, C.PREEMPTED, 40.5),
        (WORKER_EVENTS, 3600.0, C.PREEMPTED, 40.5),
        # the worker's deadline stop: exit 143 within the window before the task timeout
        ({**WORKER_EVENTS, "ended_at": 1055.0}, 60.0, C.TIMED_OUT, 55.0),
        ({**WORKER_EVENTS, "status": "failed", "exit_code": 74}, None, C.FATAL, 40.5),
        ({**WORKER_EVENTS, "process_start": "x"}, None, C.PREEMPTED, None),
        ({**WORKER_EVENTS, "ended_at": 900.0}, None, C.PREEMPTED, None),
        # no exit code: killed before it recorded its end, or not the worker's file
        ({"status": "running", "process_start": 1000.0}, None, None, None),
        ({**WORKER_EVENTS, "exit_code": True}, None, None, None),
        ({**WORKER_EVENTS, "exit_code": "143"}, None, None, None),
    ],
)
def test_worker_attempt_classes_an_unseen_attempt_from_the_workers_record(events, timeout, expected, duration):
    record = worker_attempt(0, 1, events, timeout)
    if expected is None:
        assert record is None
        return
    assert (record.key, record.source, record.observed, record.duration_seconds) == ((0, 1), "worker", True, duration)
    assert record.classify() is expected
    assert "not seen by a poll" in record.message and f"exit code {events['exit_code']}" in record.message
    assert AttemptRecord.from_dict(record.to_dict()) == record


def test_tell_replaces_only_unobserved_records_of_the_same_attempt():
    log = AttemptLog([AttemptRecord.unobserved(0, 0), AttemptRecord.unobserved(1, 0),
                      AttemptRecord(0, 1, 143, None, 2, MAINTENANCE)])
    told = worker_attempt(0, 0, WORKER_EVENTS)
    other = worker_attempt(0, 1, {**WORKER_EVENTS, "exit_code": 0})  # an observed attempt: kept as polled
    assert log.tell({(0, 0): told, (0, 1): other, (5, 5): told}) == 1
    assert [r.classify() for r in log.records] == [C.PREEMPTED, C.UNOBSERVED, C.PREEMPTED]
    assert log.records[0] is told and log.records[2].message == MAINTENANCE
    assert log.unobserved() == [log.records[1]]
